"""`rlf-cache` stats / verify / export / merge on a small two-rank cache."""
from __future__ import annotations

import json

import h5py
import pyarrow.parquet as pq
import pytest

from rlfactory_megatron.cli.cache import main
from rlfactory_megatron.envs.storage import RolloutStore, ToolArtifactCache, Topology


def _rank(rank: int) -> Topology:
    return Topology(rank=rank, world=2, backend="single", allgather=lambda obj: [obj])


@pytest.fixture
def cache_dir(tmp_path, workers):
    for rank in range(2):
        with RolloutStore(tmp_path / "rollouts", _rank(rank)) as store:
            for step in range(3):
                store.write([workers.make_record(step, rank, i) for i in range(5)])
        with ToolArtifactCache(tmp_path / "artifacts", _rank(rank), max_bytes=40_000) as cache:
            for i in range(30):
                cache.put("t", {"rank": rank, "i": i}, f"{rank}-{i:02d}|".encode() * 250)  # 1.5 KB, each its own
            cache.sync()  # single-process allgather: each rank keeps only the keys it owns, some get evicted
    return tmp_path


def test_stats(cache_dir, capsys):
    assert main(["stats", str(cache_dir / "rollouts")]) == 0
    out = capsys.readouterr().out
    assert "shard-00000-of-00002.h5: rollouts, rollouts 15, steps 0..2 (3)" in out
    assert main(["stats", str(cache_dir / "artifacts")]) == 0
    assert "artifacts, artifacts" in capsys.readouterr().out


def test_verify_passes_then_fails_on_damage(cache_dir, capsys):
    assert main(["verify", str(cache_dir / "rollouts"), str(cache_dir / "artifacts")]) == 0
    assert "4 shard(s) checked, 0 problem(s)" in capsys.readouterr().out
    damaged = cache_dir / "rollouts" / "shard-00001-of-00002.h5"
    with h5py.File(damaged, "r+") as file:
        file["rollouts/metadata"][0] = ord("!")
    assert main(["verify", str(cache_dir / "rollouts")]) == 1
    assert f"{damaged}: /rollouts/metadata row 0: not JSON" in capsys.readouterr().err
    assert main(["verify", str(cache_dir / "nothing-here")]) == 1


def test_export_jsonl_and_parquet(cache_dir, workers, tmp_path):
    expected = [workers.make_record(1, rank, i).to_json() for rank in range(2) for i in range(5)]
    assert main(["export", str(cache_dir / "rollouts"), "--step", "1", "--out", str(tmp_path / "s1.jsonl")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "s1.jsonl").read_text().splitlines()]
    assert rows == json.loads(json.dumps(expected))
    assert main(["export", str(cache_dir / "rollouts"), "--step", "1", "--out", str(tmp_path / "s1.parquet")]) == 0
    table = pq.read_table(tmp_path / "s1.parquet").to_pylist()
    assert [r["response_ids"] for r in table] == [r["response_ids"] for r in expected]
    assert [json.loads(r["metadata"]) for r in table] == [r["metadata"] for r in expected]
    assert main(["export", str(cache_dir / "rollouts"), "--step", "9", "--out", str(tmp_path / "none.jsonl")]) == 1


def test_merge_rollouts_and_artifacts(cache_dir, workers, tmp_path):
    merged = tmp_path / "merged" / "shard-00000-of-00001.h5"
    merged.parent.mkdir()
    assert main(["merge", str(cache_dir / "rollouts"), "--out", str(merged)]) == 0
    with RolloutStore(merged.parent, readonly=True) as store:
        assert store.read_step(2) == [workers.make_record(2, rank, i) for rank in range(2) for i in range(5)]
    live, values = {}, {}
    for rank in range(2):
        with ToolArtifactCache(cache_dir / "artifacts", _rank(rank), max_bytes=40_000) as cache:
            live[rank] = cache.stats()["owned_entries"]
            values[rank] = [cache.get("t", {"rank": rank, "i": i}) for i in range(30)]
    assert 0 < live[0] < 30 and 0 < live[1] < 30  # some entries were evicted: the merge must skip them
    merged = tmp_path / "merged-artifacts" / "shard-00000-of-00001.h5"
    merged.parent.mkdir()
    assert main(["merge", str(cache_dir / "artifacts"), "--out", str(merged)]) == 0
    with ToolArtifactCache(merged.parent, Topology(0, 1, "single", lambda obj: [obj])) as cache:
        assert cache.stats()["owned_entries"] == cache.stats()["entries"] == live[0] + live[1]
        assert cache.stats()["dead_bytes"] == 0
        for rank in range(2):
            assert [cache.get("t", {"rank": rank, "i": i}) for i in range(30)] == values[rank]
        assert sum(v is not None for vs in values.values() for v in vs) == live[0] + live[1]
    mixed = [str(cache_dir / "rollouts"), str(cache_dir / "artifacts")]
    assert main(["merge", *mixed, "--out", str(tmp_path / "x.h5")]) == 1

"""Acceptance: 4 ranks under mpiexec and under torchrun share rollouts and tool artifacts, a restart reads
everything back from disk, and owners evict and rewrite shards while the other ranks read them."""
from __future__ import annotations

import json
import subprocess

import pytest

pytestmark = pytest.mark.slow
WORLD = 4


@pytest.fixture
def launch(tmp_path, worker_cmd, subprocess_env, venv_bin):
    """Run a workers.py command on WORLD ranks; returns each rank's JSON result, by rank."""
    launchers = {
        "mpi": [str(venv_bin / "mpiexec"), "-n", str(WORLD)],
        "torch": [str(venv_bin / "torchrun"), "--standalone", "--nproc-per-node", str(WORLD), "--no-python"],
    }

    def run(backend: str, command: str, *extra: str) -> list[dict]:
        out = tmp_path / "out"
        out.mkdir(exist_ok=True)
        for stale in out.glob("*.json"):
            stale.unlink()
        argv = [*launchers[backend], *worker_cmd, command, str(tmp_path / "cache"), str(out), *extra]
        # A rank that dies leaves the others waiting in a collective: the timeout turns that into a failure.
        proc = subprocess.run(argv, env=subprocess_env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        results = sorted((json.loads(p.read_text()) for p in out.glob("*.json")), key=lambda r: r["rank"])
        assert [r["rank"] for r in results] == list(range(WORLD))
        return results

    return run


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_ranks_share_rollouts_and_artifacts(backend, launch, tmp_path, workers):
    per_rank = workers.ARTIFACTS_PER_RANK + 1
    everything = {"exact": WORLD * per_rank, "expected": WORLD * per_rank}
    expected = [workers.make_record(0, rank, i) for rank in range(WORLD) for i in range(workers.RECORDS_PER_RANK)]
    results = launch(backend, "rank", "first")
    for result in results:
        assert (result["world"], result["backend"]) == (WORLD, backend)
        assert result["before_sync"]["exact"] == per_rank  # only its own puts, until the step boundary
        assert result["after_sync"] == result["after_second_sync"] == everything
        assert result["rollouts"] == result["rollouts_exact"] == len(expected)
        assert result["rollout_bytes"] == sum(r.response_ids.nbytes + r.prompt_ids.nbytes for r in expected)
    assert sorted(p.name for p in (tmp_path / "cache" / "artifacts").glob("*.h5")) == [
        f"shard-{rank:05d}-of-{WORLD:05d}.h5" for rank in range(WORLD)]
    # Each key is stored once, by its owner, and every owner got some.
    assert sum(r["stats"]["owned_entries"] for r in results) == WORLD * per_rank
    assert all(r["stats"]["owned_entries"] > 0 for r in results)

    for result in launch(backend, "rank", "restart"):
        assert result["from_disk"] == everything
        assert result["rollouts_exact"] == len(expected)


def test_owners_evict_and_rewrite_while_others_read(launch):
    results = launch("mpi", "churn")
    for result in results:
        assert result["wrong"] == 0 and result["missing_last"] == 0
        assert result["stats"]["rewrites"] >= 1 and result["stats"]["owned_bytes"] <= result["stats"]["shard_cap"]
    assert len({r["stats"]["entries"] for r in results}) == 1  # every rank indexes the same live entries


def test_merge_under_mpiexec_equals_a_one_process_merge(tmp_path, workers, subprocess_env, venv_bin):
    """`mpiexec -n 2 rlf-cache merge`: the ranks merge together (in parallel through MPI-IO where h5py is
    built with MPI, else rank 0 copies while the other waits); the file holds what a one-process merge
    writes, every rank exits 0, and the summary is printed once."""
    import h5py
    import numpy as np

    from rlfactory_megatron.cli.cache import main
    from rlfactory_megatron.envs.storage import RolloutStore, Topology

    sources = tmp_path / "rollouts"
    for rank in range(3):
        with RolloutStore(sources, Topology(rank, 3, "single", lambda obj: [obj])) as store:
            for step in range(2):
                store.write([workers.make_record(step, rank, i) for i in range(7 + rank)])
    serial, parallel = tmp_path / "serial.h5", tmp_path / "parallel" / "shard-00000-of-00001.h5"
    parallel.parent.mkdir()
    assert main(["merge", str(sources), "--out", str(serial)]) == 0
    proc = subprocess.run([str(venv_bin / "mpiexec"), "-n", "2", str(venv_bin / "rlf-cache"), "merge", str(sources),
                           "--out", str(parallel)], env=subprocess_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("merged ->") == 1 and "rollouts 48 rows" in proc.stdout
    with h5py.File(serial, "r") as one, h5py.File(parallel, "r") as two:
        names = []
        one.visit(names.append)
        for name in names:
            if isinstance(one[name], h5py.Dataset):
                assert np.array_equal(one[name][()], two[name][()]), name
    with RolloutStore(parallel.parent, readonly=True) as store:
        assert store.read_step(1) == [workers.make_record(1, rank, i) for rank in range(3) for i in range(7 + rank)]

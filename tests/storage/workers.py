"""Subprocess bodies for the storage tests (one rank of an mpiexec/torchrun job; a writer that gets killed),
plus the deterministic records and artifacts both sides rebuild to compare bytes exactly."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from rlfactory_megatron.envs.storage import RolloutRecord, RolloutStore, ToolArtifactCache, detect_topology
from rlfactory_megatron.envs.storage.shard import Column, ShardSchema, Table
from rlfactory_megatron.envs.storage.topology import single_process

RECORDS_PER_RANK = 24
ARTIFACTS_PER_RANK = 40
KILL_BATCH = 48
KILL_CACHE_BYTES = 6000
TOY_SCHEMA = ShardSchema("toy", (Table("t", (
    Column("n", "int64"), Column("tokens", "int32", ragged=True), Column("vec", "float32", width=3),
    Column("doc", "uint8", ragged=True, json=True))),))


def toy_batch(start: int, count: int) -> dict:
    """Rows start..start+count of the toy table; row i has i % 7 tokens."""
    rows = range(start, start + count)
    return {"n": list(rows), "tokens": [np.arange(i % 7, dtype=np.int32) for i in rows],
            "vec": [[i, i + 0.5, -i] for i in rows],
            "doc": [np.frombuffer(f'{{"i": {i}}}'.encode(), np.uint8) for i in rows]}


def make_record(step: int, rank: int, index: int) -> RolloutRecord:
    rng = np.random.default_rng([step, rank, index])
    prompt, response = int(rng.integers(1, 300)), int(rng.integers(0, 900))
    return RolloutRecord(
        step=step, sample_id=f"r{rank}-s{index}-é",
        prompt_ids=rng.integers(0, 150_000, prompt), response_ids=rng.integers(0, 150_000, response),
        loss_mask=rng.integers(0, 2, response), logprobs=-rng.random(response),
        advantages=rng.standard_normal(response), reward=float(rng.standard_normal()),
        tool_traces=[{"name": "search", "arguments": {"q": f"{rank}/{index}"},
                      "result": "x" * int(rng.integers(0, 50))}],
        metadata={"rank": rank, "index": index, "nested": {"ok": True}},
    )


def artifact_args(rank: int, index: int) -> dict:
    return {"query": f"from rank {rank}", "index": index, "filters": {"lang": "en", "k": [1, 2]}}


def artifact_value(rank: int, index: int) -> bytes:
    return np.random.default_rng([rank, index, 7]).bytes(int(index * 37 % 3000))


def run_rank(directory: Path, out: Path, restart: bool) -> None:
    """One rank: write rollouts and artifacts, cross the step boundary, find everybody's (or, on a restart,
    find everything from disk without writing)."""
    if "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    topology = detect_topology()
    rank, world = topology.rank, topology.world
    result: dict = {"rank": rank, "world": world, "backend": topology.backend}
    with RolloutStore(directory / "rollouts", topology) as store, \
            ToolArtifactCache(directory / "artifacts", topology) as cache:
        if not restart:
            mine = [make_record(0, rank, i) for i in range(RECORDS_PER_RANK)]
            store.write(mine[: RECORDS_PER_RANK // 3])
            store.write(mine[RECORDS_PER_RANK // 3 :])
            for i in range(ARTIFACTS_PER_RANK):
                cache.put("search", artifact_args(rank, i), artifact_value(rank, i), {"rank": rank, "i": i})
            cache.put("calc", {"rank": rank}, {"answer": rank * 7})
            result["before_sync"] = _found(cache, world)
            cache.sync()
            result["after_sync"] = _found(cache, world)
            cache.sync()  # the next step: served from the owners' shards, no longer from the gathered copy
            result["after_second_sync"] = _found(cache, world)
            topology.allgather(None)  # every rank has written its rollouts before anyone reads the step
        else:
            result["from_disk"] = _found(cache, world)
        records = store.read_step(0)
        expected = [make_record(0, r, i) for r in range(world) for i in range(RECORDS_PER_RANK)]
        result["rollouts"] = len(records)
        result["rollouts_exact"] = sum(a == b for a, b in zip(sorted(records, key=_order), expected))
        result["rollout_bytes"] = sum(r.response_ids.nbytes + r.prompt_ids.nbytes for r in records)
        result["stats"] = cache.stats()
    out.write_text(json.dumps(result))


def run_churn(directory: Path, out: Path) -> None:
    """Many steps through a small cache, so owners evict and rewrite their shards while other ranks read them:
    a lookup returns the exact bytes or nothing, and the last step's entries are all found."""
    topology = detect_topology()
    rank, world = topology.rank, topology.world
    wrong = missing_last = 0
    with ToolArtifactCache(directory, topology, max_bytes=world * 30_000) as cache:
        for step in range(12):
            for i in range(6):
                cache.put("t", {"step": step, "rank": rank, "i": i}, artifact_value(step * world + rank, 1000 + i))
            cache.sync()
            for past in range(step + 1):
                for other in range(world):
                    for i in range(6):
                        hit = cache.get("t", {"step": past, "rank": other, "i": i})
                        wrong += hit is not None and hit.value != artifact_value(past * world + other, 1000 + i)
                        missing_last += hit is None and past == step
        cache.sync()  # nothing new: afterwards every rank's index holds every owner's last writes
        stats = cache.stats()
    out.write_text(json.dumps({"rank": rank, "wrong": wrong, "missing_last": missing_last, "stats": stats}))


def _order(record: RolloutRecord) -> tuple[int, int]:
    return record.metadata["rank"], record.metadata["index"]


def _found(cache: ToolArtifactCache, world: int) -> dict:
    """How many of every rank's artifacts this rank finds with exact bytes and metadata."""
    exact = 0
    for rank in range(world):
        for i in range(ARTIFACTS_PER_RANK):
            hit = cache.get("search", artifact_args(rank, i))
            exact += hit is not None and hit.value == artifact_value(rank, i) and hit.metadata == {"rank": rank, "i": i}
        hit = cache.get("calc", {"rank": rank})
        exact += hit is not None and hit.value == {"answer": rank * 7}
    return {"exact": exact, "expected": world * (ARTIFACTS_PER_RANK + 1)}


def run_killed_writer(directory: Path) -> None:
    """Append step after step (rollouts, then artifacts, then the step boundary), reporting each completed
    batch on stdout, until killed. Continues after the last step already on disk. The artifact cache holds
    about three steps, so kills also land in evictions and shard rewrites."""
    with RolloutStore(directory / "rollouts", single_process()) as store, \
            ToolArtifactCache(directory / "artifacts", single_process(), max_bytes=KILL_CACHE_BYTES) as cache:
        step = max(store.steps(), default=-1) + 1
        print("ready", flush=True)
        while True:
            store.write([make_record(step, 0, i) for i in range(KILL_BATCH)])
            print(f"rollouts {step}", flush=True)
            for i in range(8):
                cache.put("search", artifact_args(step, i), artifact_value(step, i), {"rank": step, "i": i})
            cache.sync()
            print(f"artifacts {step}", flush=True)
            step += 1


if __name__ == "__main__":
    command, directory, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]) if len(sys.argv) > 3 else None
    if command == "rank":
        run_rank(directory, out / f"rank-{os.getpid()}.json", restart=sys.argv[4] == "restart")
    elif command == "churn":
        run_churn(directory / "artifacts", out / f"rank-{os.getpid()}.json")
    elif command == "killed-writer":
        run_killed_writer(directory)
    else:
        raise SystemExit(f"unknown worker command {command!r}")

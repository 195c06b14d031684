"""`rlf-bench cache`: rollout-record write/read MB/s and tool-artifact lookup latency of the HDF5 cache, against
a raw sequential write of the same bytes to the same disk in the same run."""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from rlfactory_megatron.envs.storage import RolloutRecord, RolloutStore, ToolArtifactCache
from rlfactory_megatron.envs.storage.shard import WRITE_BEHIND_BYTES, WriteBehind
from rlfactory_megatron.envs.storage.topology import single_process


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlf-bench cache", description=__doc__)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: the temp dir)")
    parser.add_argument("--records", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=256, help="records per flushed batch")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=768)
    parser.add_argument("--artifacts", type=int, default=5000)
    parser.add_argument("--lookups", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3, help="alternating raw/cache rounds; each one's best counts")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="rlf-bench-cache-", dir=args.dir))
    try:
        batches = _batches(args)
        payload = sum(len(chunk) for batch in batches for chunk in _payload(batch))
        # Alternate the two writers and keep each one's best round: disk and CPUs are shared with other work.
        raw_s, raw_behind_s, cache_s = [], [], []
        for i in range(args.repeats):
            raw_s.append(_raw_write(workdir / f"raw-{i}.bin", batches))
            raw_behind_s.append(_raw_write(workdir / f"raw-behind-{i}.bin", batches, write_behind=True))
            cache_s.append(_rollout_write_read(workdir / f"rollouts-{i}", batches))
        write_s, write_cpu_s, read_s = (min(times[i] for times in cache_s) for i in range(3))
        wall, cpu = _lookup_latency(workdir / "artifacts", args.artifacts, args.lookups)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    raw, write = payload / min(raw_s) / 1e6, payload / write_s / 1e6
    raw_behind = payload / min(raw_behind_s) / 1e6
    print(f"payload {payload / 1e6:.1f} MB in {len(batches)} batches of {args.batch} records under "
          f"{workdir.parent}, best of {args.repeats} rounds")
    print(f"raw sequential write + fsync : {raw:8.1f} MB/s  (the limit)")
    print(f"  the same, with write-behind: {raw_behind:8.1f} MB/s  (writeback started every "
          f"{WRITE_BEHIND_BYTES >> 20} MB, as the cache does: the stricter limit)")
    print(f"rollout write + fsync        : {write:8.1f} MB/s  = {write / raw:.0%} of raw, "
          f"{write / raw_behind:.0%} of raw with write-behind  (target >= 50% of raw: {_verdict(write >= raw / 2)})")
    print(f"rollout write, CPU-bound     : {payload / write_cpu_s / 1e6:8.1f} MB/s  (payload / CPU seconds of "
          "all threads, the write-behind helper's included)")
    print(f"rollout read (all steps)     : {payload / read_s / 1e6:8.1f} MB/s")
    print(f"artifact lookup (hit), wall  : p50 {wall[0] * 1e3:.3f} ms, p99 {wall[1] * 1e3:.3f} ms  "
          f"(target p99 <= 1 ms: {_verdict(wall[1] <= 1e-3)})")
    print(f"artifact lookup (hit), CPU   : p50 {cpu[0] * 1e3:.3f} ms, p99 {cpu[1] * 1e3:.3f} ms  (without time "
          f"spent descheduled; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    return 0


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def _batches(args: argparse.Namespace) -> list[list[RolloutRecord]]:
    rng = np.random.default_rng(0)
    records = [
        RolloutRecord(
            step=i * 4 // args.records, sample_id=f"sample-{i}",
            prompt_ids=rng.integers(0, 150_000, args.prompt_len),
            response_ids=rng.integers(0, 150_000, args.response_len),
            loss_mask=rng.integers(0, 2, args.response_len), logprobs=-rng.random(args.response_len),
            advantages=rng.standard_normal(args.response_len), reward=float(rng.random()),
            tool_traces=[{"name": "search", "arguments": {"query": f"q{i}"}, "latency_s": 0.1}],
            metadata={"data_source": "bench", "index": i},
        )
        for i in range(args.records)
    ]
    return [records[i : i + args.batch] for i in range(0, len(records), args.batch)]


def _payload(batch: list[RolloutRecord]) -> list[bytes]:
    """The record bytes the cache stores, as one raw buffer per field and batch."""
    out = []
    for name in ("prompt_ids", "response_ids", "loss_mask", "logprobs", "advantages"):
        out.append(np.concatenate([getattr(r, name) for r in batch]).tobytes())
    out.append("".join(r.sample_id + repr(r.tool_traces) + repr(r.metadata) for r in batch).encode())
    out.append(np.array([(r.step, r.reward) for r in batch]).tobytes())
    return out


def _raw_write(path: Path, batches: list[list[RolloutRecord]], write_behind: bool = False) -> float:
    """Seconds to write the payload with plain file writes (one flush per batch) and fsync; open not timed.
    With `write_behind`, each flush may start the writeback as the cache's shards do."""
    buffers = [_payload(batch) for batch in batches]
    with open(path, "wb") as handle:
        behind = WriteBehind(handle.fileno()) if write_behind else None
        start = time.perf_counter()
        for chunks in buffers:
            for chunk in chunks:
                handle.write(chunk)
            handle.flush()
            if behind is not None:
                behind.wrote()
        os.fsync(handle.fileno())
        if behind is not None:
            behind.close()
        return time.perf_counter() - start


def _rollout_write_read(directory: Path, batches: list[list[RolloutRecord]]) -> tuple[float, float, float]:
    """Seconds to append every batch and fsync (open not timed, as for the raw file), the CPU seconds of
    that, and seconds to read everything back."""
    with RolloutStore(directory, topology=single_process()) as store:
        start, start_cpu = time.perf_counter(), time.process_time()
        for batch in batches:
            store.write(batch)
        store.fsync()
        write_s, write_cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
    with RolloutStore(directory, readonly=True) as store:
        start = time.perf_counter()
        count = sum(len(store.read_step(step)) for step in store.steps())
        read_s = time.perf_counter() - start
    assert count == sum(map(len, batches)), f"read back {count} records"
    return write_s, write_cpu_s, read_s


def _lookup_latency(directory: Path, entries: int, lookups: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """(p50, p99) of each hit's wall time and of its thread CPU time."""
    rng = np.random.default_rng(1)
    with ToolArtifactCache(directory, topology=single_process()) as cache:
        for i in range(entries):
            cache.put("search", {"query": f"q{i}", "top_k": 5}, rng.bytes(1024), {"latency_s": 0.5})
        cache.sync()
        wall, cpu = np.empty(lookups), np.empty(lookups)
        for n, i in enumerate(rng.integers(0, entries, lookups)):
            start, start_cpu = time.perf_counter(), time.thread_time()
            hit = cache.get("search", {"top_k": 5, "query": f"q{i}"})
            wall[n], cpu[n] = time.perf_counter() - start, time.thread_time() - start_cpu
            assert hit is not None
    return tuple(np.percentile(wall, [50, 99]).tolist()), tuple(np.percentile(cpu, [50, 99]).tolist())

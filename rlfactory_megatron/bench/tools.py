"""`rlf-bench tools`: throughput of N concurrent callers of a fixed-latency tool through the Ray
tool pool (calls over its per-actor socket channels), as a fraction of the ideal min(N, pool concurrency) / L,
next to an in-process baseline."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

from rlfactory_megatron.envs.tool_pool import ToolPool, ToolPoolConfig, ensure_ray
from rlfactory_megatron.envs.tools import ToolBox, ToolSpec


async def _closed_loop(call, callers: int, rounds: int) -> float:
    """Each caller issues `rounds` calls back to back; returns calls per second."""

    async def caller() -> None:
        for _ in range(rounds):
            result = await call()
            if result.is_error:
                raise RuntimeError(f"benchmark call failed: {result.text}")

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    return callers * rounds / (time.perf_counter() - start)


async def _run(args: argparse.Namespace) -> dict[str, float]:
    spec = ToolSpec("sleep", {"latency_s": args.latency_ms / 1000})
    box = await ToolBox.build([spec])
    in_process = await _closed_loop(lambda: box.run("sleep", {"text": "x"}), args.calls, args.rounds)

    config = ToolPoolConfig(
        tools=[spec], num_actors=args.actors, num_cpus_per_actor=args.cpus_per_actor,
        max_concurrency=args.max_concurrency, call_timeout_s=30.0, max_queue=max(args.calls, 1),
    )
    pool = ToolPool(config)
    await pool.start()
    await _closed_loop(lambda: pool.call("sleep", {"text": "x"}), args.calls, 2)  # warm-up
    through_pool = await _closed_loop(lambda: pool.call("sleep", {"text": "x"}), args.calls, args.rounds)
    latency = pool.metrics()["sleep"]
    await pool.close()

    concurrency = min(args.calls, args.actors * args.max_concurrency)
    ideal = concurrency / (args.latency_ms / 1000)
    return {"ideal": ideal, "in_process": in_process, "pool": through_pool, **latency}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlf-bench tools", description=__doc__)
    parser.add_argument("--calls", "-n", type=int, default=256, help="concurrent callers (N)")
    parser.add_argument("--latency-ms", "-l", type=float, default=50.0, help="fixed tool latency (L)")
    parser.add_argument("--rounds", type=int, default=20, help="calls per caller")
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--max-concurrency", type=int, default=128, help="calls in flight per actor")
    parser.add_argument("--cpus-per-actor", type=float, default=0.5)
    parser.add_argument("--target", type=float, default=0.90, help="exit 1 below this fraction of ideal")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)

    ensure_ray(num_cpus=os.cpu_count())
    r = asyncio.run(_run(args))
    print(f"rlf-bench tools: N={args.calls} callers x {args.rounds} calls, L={args.latency_ms:g} ms, "
          f"{args.actors} actors x {args.max_concurrency} concurrency "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    print(f"  ideal (concurrency / L)   {r['ideal']:9.0f} calls/s")
    print(f"  in-process asyncio        {r['in_process']:9.0f} calls/s  {r['in_process'] / r['ideal']:6.1%} of ideal")
    print(f"  Ray tool pool             {r['pool']:9.0f} calls/s  {r['pool'] / r['ideal']:6.1%} of ideal")
    print(f"  pool latency p50/p90/p99  {r['latency_p50_s'] * 1e3:.1f} / {r['latency_p90_s'] * 1e3:.1f} / "
          f"{r['latency_p99_s'] * 1e3:.1f} ms (tool itself: {args.latency_ms:g} ms)")
    fraction = r["pool"] / r["ideal"]
    print(f"  target >= {args.target:.0%} of ideal: {'met' if fraction >= args.target else 'NOT met'}")
    if args.json:
        Path(args.json).write_text(json.dumps({**r, "pool_fraction_of_ideal": fraction, "target": args.target}, indent=2))
    return 0 if fraction >= args.target else 1

"""`rlf-bench rollout`: generation through the request router on 1 and on 2 disaggregated engines
(vLLM in Ray actors, one CPU thread each on CPU), on the same seeded prompts, in one run.

Reports tokens/s for each, the scaling efficiency (2-engine tokens/s over twice the 1-engine
figure), the router's imbalance (max / mean engine busy time) and the time of one weight sync
through the broadcast group to 1 and to 2 engines (ratio to the 1-engine sync).

On a shared 2-core host one measurement of a few seconds moves by 20% from run to run, and a
drift (another process, the CPU's clock) favours whichever engine count runs first. So the run
makes `--rounds` rounds that alternate which count goes first, and reports the median over the
rounds of each figure (every round's figures beside it); each round times SYNC_REPEATS syncs
per engine count after a warm-up one.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time


SYNC_REPEATS = 5  # timed syncs per engine count


def _generate(engines, prompts: list[list[int]], max_tokens: int, seed: int) -> dict:
    """All prompts at once through a router over `engines`: tokens/s and each engine's busy time."""
    from rlfactory_megatron.rollout.engines import SamplingConfig
    from rlfactory_megatron.rollout.fronts import serving
    from rlfactory_megatron.rollout.router import EngineRouter

    router = EngineRouter([serving(engine) for engine in engines])
    sampling = SamplingConfig(temperature=1.0, max_tokens=max_tokens)

    async def run():
        try:
            outs = await asyncio.gather(*(router.session().generate(p, dataclasses.replace(sampling, seed=seed + i))
                                          for i, p in enumerate(prompts)))
            return outs
        finally:
            for front in router.fronts:
                await front.close()

    start = time.perf_counter()
    outs = asyncio.run(run())
    seconds = time.perf_counter() - start
    tokens = sum(len(ids) for ids, _ in outs)
    busy = [front.busy_s for front in router.fronts]
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
            "engine_busy_s": [round(b, 3) for b in busy],
            "imbalance": round(max(busy) / max(sum(busy) / len(busy), 1e-9), 3),
            "token_ids": [ids for ids, _ in outs]}


def _median_run(runs: list[dict]) -> dict:
    """The figures of the round with the median tokens/s (a whole round's, so that they agree),
    plus every round's tokens/s."""
    ordered = sorted(runs, key=lambda run: run["tokens_per_s"])
    median = ordered[(len(ordered) - 1) // 2]
    return {**{k: v for k, v in median.items() if k != "token_ids"},
            "tokens_per_s_per_round": [run["tokens_per_s"] for run in runs]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlf-bench rollout", description=__doc__)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of both engine counts, alternating which goes first; figures are medians")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)

    import ray
    import torch

    from rlfactory_megatron.actor.model import MegatronModel
    from rlfactory_megatron.models.builder import BuildOptions
    from rlfactory_megatron.models.hf_arch import load_arch
    from rlfactory_megatron.models.tiny import make_tiny_hf_model
    from rlfactory_megatron.rollout.ray_engine import BroadcastTransport, RayVLLMEngine
    from rlfactory_megatron.rollout.weight_sync import sync_weights
    from rlfactory_megatron.runtime.distributed import ParallelSizes, init_distributed
    from rlfactory_megatron.runtime.launch_env import ALONE

    workdir = tempfile.mkdtemp(prefix="rlf-bench-rollout-")
    hf_dir = os.path.join(workdir, "model")
    heads = max(args.hidden // 64, 1)
    make_tiny_hf_model("qwen3", hf_dir, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                       num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads,
                       head_dim=64, vocab_size=4096)
    init_distributed(ParallelSizes(1, 1), launch=ALONE)
    ray.init(address="local", num_cpus=max(3, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    gpus = 1 if torch.cuda.is_available() else 0
    engines = [RayVLLMEngine(hf_dir, num_cpus=1, num_gpus=gpus, max_model_len=args.prompt_tokens + args.max_tokens,
                             memory_utilization=0.2) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, 4000, (args.prompts, args.prompt_tokens), generator=gen).tolist()
    _generate(engines, prompts[:4], 8, seed=1)  # warm-up: first calls allocate
    actor = MegatronModel(load_arch(hf_dir), hf_dir, BuildOptions())
    runs = {1: [], 2: []}
    syncs = {1: [], 2: []}
    for round_index in range(args.rounds):
        for count in ((1, 2) if round_index % 2 == 0 else (2, 1)):
            runs[count].append(_generate(engines[:count], prompts, args.max_tokens, seed=1))
            transport = BroadcastTransport(engines[:count])  # a group of the sender and these engines
            sync_weights(actor, transport, args.bucket_mb)  # warm-up
            syncs[count] += [sync_weights(actor, transport, args.bucket_mb).seconds for _ in range(SYNC_REPEATS)]
    one, two = (_median_run(runs[count]) for count in (1, 2))
    results = {
        "prompts": args.prompts, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "one_engine": one, "two_engines": two,
        "same_samples": all(run["token_ids"] == runs[1][0]["token_ids"] for run in runs[1] + runs[2]),
        "scaling_efficiency": round(two["tokens_per_s"] / (2 * one["tokens_per_s"]), 3),
        "scaling_efficiency_per_round": [round(b["tokens_per_s"] / (2 * a["tokens_per_s"]), 3)
                                         for a, b in zip(runs[1], runs[2])],
        "sync_one_engine_s": round(statistics.median(syncs[1]), 3),
        "sync_two_engines_s": round(statistics.median(syncs[2]), 3),
    }
    results["sync_two_over_one"] = round(results["sync_two_engines_s"] / results["sync_one_engine_s"], 3)
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    for engine in engines:
        engine.close()
    ray.shutdown()
    shutil.rmtree(workdir, ignore_errors=True)
    return 0

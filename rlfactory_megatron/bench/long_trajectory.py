"""`rlf-bench long-trajectory`: peak memory per rank and step time of actor updates on long
multi-turn agent trajectories at context parallelism 1 and 2 (`parallel.cp`), in one run.

Each CP size runs on fresh local ranks (cp processes: gloo on CPU; on GPU one device each) that
build the actor on a model of the given shape (made here, random weights) and time `--steps`
PPO updates after `--warmup`, each over `--trajectories` trajectories of `--tokens` tokens: a
prompt, then policy turns and tool observations (loss-masked) in turn, one trajectory per
micro-batch. A rank's peak is the step's high-water mark above the memory in use as it starts
(bench/memory.py; weights, gradients and Adam's states are in place by then): the activations
and the step's transients. Target: CP 2's peak <= 0.6 x CP 1's (exit 1 below it).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

MiB = 1 << 20
TARGET = 0.6


def _parse(argv: list[str]) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="rlf-bench long-trajectory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per trajectory (one micro-batch each)")
    p.add_argument("--trajectories", type=int, default=2, help="trajectories per update (one optimizer step)")
    p.add_argument("--turn", type=int, default=512, help="tokens per policy turn; each is followed by a tool "
                                                         "observation of half as many (loss-masked)")
    p.add_argument("--cp", default="1,2", help="context-parallel sizes to compare; the first is the baseline")
    # A CPU-sized model by default: its activations, not its weights, are what CP splits.
    p.add_argument("--hidden", type=int, default=4096 if cuda else 256)
    p.add_argument("--layers", type=int, default=8 if cuda else 4)
    p.add_argument("--heads", type=int, default=32 if cuda else 4, help="attention heads (128-dim on GPU, 64 on CPU)")
    p.add_argument("--kv-heads", type=int, default=8 if cuda else 2)
    # <= 2^25 / tokens on CPU, so that the fused log-prob's [chunk, vocab] buffers hold the whole
    # micro-batch and scale with it as the activations do
    p.add_argument("--vocab", type=int, default=32768 if cuda else 4096)
    p.add_argument("--dtype", default="bfloat16" if cuda else "float32", choices=["float32", "bfloat16"])
    p.add_argument("--warmup", type=int, default=1, help="updates before the timed ones (Adam's states appear)")
    p.add_argument("--steps", type=int, default=2, help="timed updates; the peak is their highest, the time their mean")
    p.add_argument("--target", type=float, default=TARGET, help="exit 1 if CP 2 / CP 1 peak is above this")
    p.add_argument("--json", default=None, help="write the results to this file")
    return p.parse_args(argv)


def trajectory_batch(rows: int, tokens: int, turn: int, vocab: int, seed: int = 0):
    """`rows` trajectories of `tokens` tokens: a prompt of `turn` / 2 tokens, then policy turns of
    `turn` tokens (trained) and tool observations of `turn` / 2 (loss-masked) in turn."""
    from rlfactory_megatron.actor.batch import RolloutBatch

    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, tokens)
    start, policy = turn // 2, True
    while start < tokens:
        length = turn if policy else turn // 2
        if policy:
            mask[:, start:start + length] = 1
        start, policy = start + length, not policy
    return RolloutBatch(torch.randint(0, vocab, (rows, tokens), generator=gen), torch.full((rows,), tokens), mask,
                        advantages=torch.randn(rows, tokens, generator=gen))


def _rank(hf_dir: str, cp: int, args: dict) -> dict:
    """One rank of a CP group: warm-up and timed actor updates, its peak memory and step times."""
    from rlfactory_megatron.actor.actor import Actor
    from rlfactory_megatron.bench.memory import peak, reset_peak, return_freed_memory
    from rlfactory_megatron.config import load_config
    from rlfactory_megatron.models.builder import BuildOptions
    from rlfactory_megatron.models.hf_arch import load_arch
    from rlfactory_megatron.runtime.cpu_compat import compute_device
    from rlfactory_megatron.runtime.distributed import ParallelSizes, destroy_distributed, init_distributed

    return_freed_memory()
    init_distributed(ParallelSizes(cp=cp), seed=0)
    try:
        cfg = load_config(overrides=[f"parallel.cp={cp}", f"actor.max_tokens_per_microbatch={args['tokens']}",
                                     f"actor.mini_batch_size={args['trajectories']}", "actor.optim.lr=1e-6"])
        arch = load_arch(hf_dir)
        actor = Actor(cfg.actor, arch, hf_dir, BuildOptions(params_dtype=args["dtype"]), total_steps=16)
        batch = trajectory_batch(args["trajectories"], args["tokens"], args["turn"], arch.vocab_size)
        batch = batch.with_fields(old_log_probs=actor.compute_log_probs(batch)["log_probs"])
        device = compute_device()
        for _ in range(args["warmup"]):
            actor.update(batch)
        peaks, times, metrics = [], [], {}
        for _ in range(args["steps"]):
            base = reset_peak(device)
            start = time.perf_counter()
            metrics = actor.update(batch)
            times.append(time.perf_counter() - start)
            peaks.append(peak(device) - base)
        return {"peak_mib": max(peaks) / MiB, "step_s": sum(times) / len(times),
                "grad_norm": metrics["actor/grad_norm"], "pg_loss": metrics["actor/pg_loss"]}
    finally:
        destroy_distributed()


def _model(root: str, args: argparse.Namespace) -> str:
    from rlfactory_megatron.models.tiny import make_tiny_hf_model

    head_dim = 128 if torch.cuda.is_available() else 64
    return str(make_tiny_hf_model("qwen3", os.path.join(root, "model"), hidden_size=args.hidden,
                                  intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                  head_dim=head_dim, vocab_size=args.vocab,
                                  max_position_embeddings=max(args.tokens, 1024)))


def main(argv: list[str]) -> int:
    from rlfactory_megatron.bench.memory import RETURN_FREED_MEMORY_ENV
    from rlfactory_megatron.runtime.distributed import spawn_local_workers

    args = _parse(argv)
    sizes = [int(c) for c in args.cp.split(",")]
    if any(args.tokens % (2 * cp) for cp in sizes):
        print(f"rlf-bench long-trajectory: --tokens {args.tokens} must be a multiple of 2 x every CP size")
        return 2
    os.environ.update(RETURN_FREED_MEMORY_ENV)  # read by the ranks' allocator as they start
    settings = {k: getattr(args, k) for k in ("tokens", "trajectories", "turn", "dtype", "warmup", "steps")}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"rlf-bench long-trajectory: {args.trajectories} trajectories x {args.tokens} tokens (turns of {args.turn}, "
          f"tool observations of {args.turn // 2} loss-masked) per update; qwen3 shape hidden={args.hidden} "
          f"layers={args.layers} heads={args.heads}/{args.kv_heads} vocab={args.vocab} {args.dtype} on {device}")
    print(f"{'cp':>3} {'ranks':>6} {'peak MiB/rank':>14} {'step s':>8} {'tokens/s':>9} {'grad norm':>10}")
    results = []
    with tempfile.TemporaryDirectory() as root:
        hf_dir = _model(root, args)
        for cp in sizes:
            if device == "cuda" and torch.cuda.device_count() < cp:
                print(f"{cp:>3} skipped: needs {cp} GPUs, this machine has {torch.cuda.device_count()}")
                continue
            ranks = spawn_local_workers(_rank, cp, hf_dir, cp, settings)
            result = {"cp": cp, "peak_mib": max(r["peak_mib"] for r in ranks),
                      "step_s": max(r["step_s"] for r in ranks), "grad_norm": ranks[0]["grad_norm"],
                      "pg_loss": ranks[0]["pg_loss"], "ranks": ranks}
            results.append(result)
            tokens_per_s = args.trajectories * args.tokens / result["step_s"]
            print(f"{cp:>3} {cp:>6} {result['peak_mib']:>14.0f} {result['step_s']:>8.2f} {tokens_per_s:>9.0f} "
                  f"{result['grad_norm']:>10.6f}", flush=True)
    summary = {"settings": settings, "device": device, "results": results}
    code = 0
    if len(results) >= 2 and results[0]["cp"] == 1 and 2 in [r["cp"] for r in results]:
        one, two = results[0], next(r for r in results if r["cp"] == 2)
        ratio = two["peak_mib"] / one["peak_mib"]
        same = abs(two["grad_norm"] - one["grad_norm"]) / max(abs(one["grad_norm"]), 1e-12)
        summary.update(peak_ratio_cp2=ratio, step_time_ratio_cp2=two["step_s"] / one["step_s"], grad_norm_rel_diff=same)
        met = ratio <= args.target
        print(f"CP 2 / CP 1: peak memory per rank {ratio:.2f}x (target <= {args.target}: {'met' if met else 'MISSED'}), "
              f"step time {two['step_s'] / one['step_s']:.2f}x; same update (grad norm rel. diff {same:.1e})")
        code = 0 if met else 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return code

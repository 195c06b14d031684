"""`rlf-bench moe`: actor update and weight sync time of a Qwen3-MoE model at expert parallelism 1
and 2, against the dense Qwen3 model of the same active size, in one run.

The dense model is the MoE model with one MLP of top_k x the expert width in place of the
experts: a token computes the same FLOPs in both (the router's few more aside). Each layout runs
on fresh local ranks (gloo on CPU; on GPU one device each): the MoE model at EP = ranks (its
experts split across them, tokens dispatched to their experts), the dense one data-parallel on
as many ranks. Every rank times `--steps` PPO updates after `--warmup` over its share of
`--rows` trajectories of `--tokens` tokens, then weight syncs into a vLLM engine on rank 0 (its
engine core in a process of its own, as in every multi-rank run; the first sync untimed, then the
best of `--sync-repeats`, each the slowest rank's): with EP the experts are gathered across the
EP group bucket by bucket, on every rank, so that an engine gets whole tensors. Baseline: the
dense model at the same rank count.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch


def _parse(argv: list[str]) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="rlf-bench moe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ep", default="1,2", help="expert-parallel sizes (= ranks) to run; the dense model runs at each")
    p.add_argument("--hidden", type=int, default=2048 if cuda else 256)
    p.add_argument("--layers", type=int, default=8 if cuda else 4)
    p.add_argument("--heads", type=int, default=16 if cuda else 4, help="attention heads (128-dim on GPU, 64 on CPU)")
    p.add_argument("--kv-heads", type=int, default=4 if cuda else 2)
    p.add_argument("--experts", type=int, default=64 if cuda else 8)
    p.add_argument("--top-k", type=int, default=8 if cuda else 2)
    p.add_argument("--expert-ffn", type=int, default=768 if cuda else 128, help="each expert's intermediate size")
    p.add_argument("--vocab", type=int, default=32768 if cuda else 4096)
    p.add_argument("--dtype", default="bfloat16" if cuda else "float32", choices=["float32", "bfloat16"])
    p.add_argument("--rows", type=int, default=8, help="trajectories per update, split over the data-parallel ranks")
    p.add_argument("--tokens", type=int, default=1024 if cuda else 256, help="tokens per trajectory")
    p.add_argument("--warmup", type=int, default=1, help="updates before the timed ones (Adam's states appear)")
    p.add_argument("--steps", type=int, default=2, help="timed updates; their mean")
    p.add_argument("--bucket-mb", type=float, default=512.0 if cuda else 64.0)
    p.add_argument("--sync-repeats", type=int, default=2, help="timed syncs after the first; their best")
    p.add_argument("--json", default=None, help="write the results to this file")
    return p.parse_args(argv)


def _models(root: str, args: argparse.Namespace) -> dict[str, str]:
    """The MoE model and its dense twin (HF folders, random weights)."""
    from rlfactory_megatron.models.tiny import make_tiny_hf_model

    shape = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                 num_key_value_heads=args.kv_heads, head_dim=128 if torch.cuda.is_available() else 64,
                 vocab_size=args.vocab, max_position_embeddings=max(args.tokens, 1024))
    return {
        "moe": str(make_tiny_hf_model("qwen3_moe", os.path.join(root, "moe"), num_experts=args.experts,
                                      num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_ffn,
                                      intermediate_size=args.top_k * args.expert_ffn, **shape)),
        "dense": str(make_tiny_hf_model("qwen3", os.path.join(root, "dense"),
                                        intermediate_size=args.top_k * args.expert_ffn, **shape)),
    }


def parameter_counts(hf_dir: str) -> tuple[int, int]:
    """(all parameters, those a token computes with): a MoE layer's token uses top_k of its experts."""
    from rlfactory_megatron.models.hf_arch import load_arch

    arch = load_arch(hf_dir)
    total, experts = arch.parameter_count(), arch.expert_parameter_count()
    if arch.moe is None:
        return total, total
    return total, total - experts + experts * arch.moe.top_k // arch.moe.num_experts


def _rank(hf_dir: str, ep: int, settings: dict) -> dict:
    """One rank: timed updates on its rows, then timed syncs (into rank 0's engine)."""
    import torch.distributed as dist

    from rlfactory_megatron.actor.actor import Actor
    from rlfactory_megatron.bench.long_trajectory import trajectory_batch
    from rlfactory_megatron.config import load_config
    from rlfactory_megatron.models.builder import BuildOptions, MoEOptions
    from rlfactory_megatron.models.hf_arch import load_arch
    from rlfactory_megatron.rollout.engines import VLLMEngine
    from rlfactory_megatron.rollout.weight_sync import InProcessTransport, sync_weights
    from rlfactory_megatron.runtime.distributed import ParallelSizes, destroy_distributed, init_distributed

    init_distributed(ParallelSizes(ep=ep), seed=0)
    engine = None
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        rows = settings["rows"] // world
        cfg = load_config(overrides=[f"parallel.ep={ep}", f"actor.max_tokens_per_microbatch={settings['tokens']}",
                                     f"actor.mini_batch_size={settings['rows']}", "actor.optim.lr=1e-6",
                                     "actor.kl_loss_coef=0"])
        arch = load_arch(hf_dir)
        build = BuildOptions(params_dtype=settings["dtype"], moe=MoEOptions(**cfg.model.moe))
        actor = Actor(cfg.actor, arch, hf_dir, build, total_steps=16)
        # Each data-parallel rank trains its own rows (seeded by rank), as a run's ranks do.
        batch = trajectory_batch(rows, settings["tokens"], settings["tokens"] // 4, arch.vocab_size, seed=rank)
        batch = batch.with_fields(old_log_probs=actor.compute_log_probs(batch)["log_probs"])
        for _ in range(settings["warmup"]):
            actor.update(batch)
        start = time.perf_counter()
        for _ in range(settings["steps"]):
            metrics = actor.update(batch)
        update_s = (time.perf_counter() - start) / settings["steps"]

        # The engine on rank 0: the other ranks take part in the export's gathers and send nothing
        # (a colocated run's ranks each send the same buckets into an engine of their own, at once).
        if rank == 0:
            engine = VLLMEngine(hf_dir, dtype=settings["dtype"], max_model_len=256, max_num_seqs=2,
                                memory_utilization=0.05, in_process=False)
        transport = InProcessTransport(engine) if engine is not None else None
        sync_weights(actor.megatron, transport, settings["bucket_mb"])  # start-up allocations: untimed
        seconds = []
        for _ in range(settings["sync_repeats"]):
            dist.barrier()  # every rank starts the export together
            start = time.perf_counter()
            stats = sync_weights(actor.megatron, transport, settings["bucket_mb"])
            seconds.append(time.perf_counter() - start)
        out = {"update_s": update_s, "tokens": rows * settings["tokens"], "grad_norm": metrics["actor/grad_norm"],
               "sync_s": min(seconds)}
        if stats is not None:  # the sender's
            out.update(sync_bytes=stats.bytes, sync_buckets=stats.buckets)
        return out
    finally:
        if engine is not None:
            engine.close()
        destroy_distributed()


def main(argv: list[str]) -> int:
    from rlfactory_megatron.runtime.distributed import spawn_local_workers

    args = _parse(argv)
    try:
        sizes = [int(e) for e in args.ep.split(",")]
    except ValueError:
        sizes, problems = [], [f"--ep {args.ep}: give expert-parallel sizes, comma-separated (e.g. 1,2)"]
    else:
        problems = [f"--ep {e}: must be >= 1 and divide --experts {args.experts} and --rows {args.rows}"
                    for e in sizes if e < 1 or args.experts % e or args.rows % e]
    if args.top_k > args.experts:
        problems.append(f"--top-k {args.top_k}: at most --experts {args.experts}")
    if args.steps < 1 or args.sync_repeats < 1 or args.warmup < 0:
        problems.append("--steps and --sync-repeats: at least 1; --warmup: at least 0")
    if problems:
        print(f"rlf-bench moe: {problems[0]}")
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    settings = {k: getattr(args, k) for k in ("rows", "tokens", "dtype", "warmup", "steps", "bucket_mb", "sync_repeats")}
    print(f"rlf-bench moe: qwen3_moe hidden={args.hidden} layers={args.layers} {args.experts} experts top-{args.top_k} "
          f"(expert width {args.expert_ffn}) vs qwen3 dense of width {args.top_k * args.expert_ffn}; "
          f"{args.rows} x {args.tokens} tokens per update; {args.dtype} on {device}")
    print(f"{'model':>6} {'ranks':>5} {'ep':>3} {'params M':>9} {'active M':>9} {'update s':>9} {'tokens/s':>9} "
          f"{'sync s':>7} {'sync GB':>8} {'GB/s':>6}")
    results = []
    with tempfile.TemporaryDirectory() as root:
        models = _models(root, args)
        counts = {kind: parameter_counts(path) for kind, path in models.items()}
        for ranks in sizes:
            if device == "cuda" and torch.cuda.device_count() < ranks:
                print(f"{'':>6} {ranks:>5} skipped: needs {ranks} GPUs, this machine has {torch.cuda.device_count()}")
                continue
            for kind in ("dense", "moe"):
                ep = ranks if kind == "moe" else 1
                per_rank = spawn_local_workers(_rank, ranks, models[kind], ep, settings)
                update_s = max(r["update_s"] for r in per_rank)
                sync_s = max(r["sync_s"] for r in per_rank)
                result = {"model": kind, "ranks": ranks, "ep": ep, "params": counts[kind][0],
                          "active_params": counts[kind][1], "update_s": update_s,
                          "tokens_per_s": sum(r["tokens"] for r in per_rank) / update_s, "sync_s": sync_s,
                          "sync_bytes": per_rank[0]["sync_bytes"], "sync_GB_per_s": per_rank[0]["sync_bytes"] / sync_s / 1e9,
                          "per_rank": per_rank}
                results.append(result)
                print(f"{kind:>6} {ranks:>5} {ep if kind == 'moe' else '-':>3} {result['params'] / 1e6:>9.2f} "
                      f"{result['active_params'] / 1e6:>9.2f} {update_s:>9.3f} {result['tokens_per_s']:>9.0f} "
                      f"{sync_s:>7.3f} {result['sync_bytes'] / 1e9:>8.3f} {result['sync_GB_per_s']:>6.2f}", flush=True)
    ratios = {}
    for ranks in sorted({r["ranks"] for r in results}):
        dense, moe = (next(r for r in results if r["ranks"] == ranks and r["model"] == kind) for kind in ("dense", "moe"))
        ratios[f"moe_over_dense_at_{ranks}_ranks"] = {
            "update_s": moe["update_s"] / dense["update_s"], "sync_s": moe["sync_s"] / dense["sync_s"],
            "sync_bytes": moe["sync_bytes"] / dense["sync_bytes"]}
        r = ratios[f"moe_over_dense_at_{ranks}_ranks"]
        print(f"MoE / dense at {ranks} rank(s) (ep {moe['ep']}): update {r['update_s']:.2f}x, sync {r['sync_s']:.2f}x "
              f"(bytes {r['sync_bytes']:.2f}x)")
    moes = {r["ep"]: r for r in results if r["model"] == "moe"}
    if 1 in moes and 2 in moes:
        ratios["ep2_over_ep1"] = {"update_s": moes[2]["update_s"] / moes[1]["update_s"],
                                  "sync_s": moes[2]["sync_s"] / moes[1]["sync_s"]}
        print(f"MoE at EP 2 / EP 1: update {ratios['ep2_over_ep1']['update_s']:.2f}x (half the rows per rank), "
              f"sync {ratios['ep2_over_ep1']['sync_s']:.2f}x (experts gathered across the EP group)")
    if args.json:
        settings.update(hidden=args.hidden, layers=args.layers, experts=args.experts, top_k=args.top_k,
                        expert_ffn=args.expert_ffn, vocab=args.vocab)
        with open(args.json, "w") as f:
            json.dump({"settings": settings, "device": device, "results": results, "ratios": ratios}, f, indent=1)
    return 0

"""`rlf-bench weight-sync`: Megatron -> vLLM bucketed sync vs baselines measured in the same run.

The sync into an engine in this process and into one in a process of its own (how every
multi-rank run's colocated engines live: fed by handle), against a plain memcpy of the same
bytes (the local limit) and the disk route (save a HF checkpoint, then have the engine reload it
from disk). One training process, TP=1, CPU or GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import torch


def _memcpy_seconds(total_bytes: int, repeats: int = 3) -> float:
    src = torch.empty(total_bytes, dtype=torch.uint8)
    src.fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlf-bench weight-sync", description=__doc__)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[64.0, 512.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)

    from rlfactory_megatron.actor.model import MegatronModel
    from rlfactory_megatron.models.builder import BuildOptions
    from rlfactory_megatron.models.hf_arch import load_arch
    from rlfactory_megatron.models.hf_checkpoint import write_safetensors_shards
    from rlfactory_megatron.models.tiny import make_tiny_hf_model
    from rlfactory_megatron.rollout.engines import VLLMEngine
    from rlfactory_megatron.rollout.weight_sync import InProcessTransport, sync_weights
    from rlfactory_megatron.runtime.distributed import ParallelSizes, init_distributed
    from rlfactory_megatron.runtime.launch_env import ALONE

    workdir = tempfile.mkdtemp(prefix="rlf-bench-sync-")
    hf_dir = os.path.join(workdir, "model")
    heads = max(args.hidden // 64, 1)
    make_tiny_hf_model("qwen2", hf_dir, hidden_size=args.hidden, intermediate_size=args.hidden * 4,
                       num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1),
                       head_dim=64, vocab_size=args.vocab)
    init_distributed(ParallelSizes(1, 1), launch=ALONE)
    arch = load_arch(hf_dir)
    actor = MegatronModel(arch, hf_dir, BuildOptions())
    engine = VLLMEngine(hf_dir, max_model_len=256, max_num_seqs=4, memory_utilization=0.35)
    other = VLLMEngine(hf_dir, max_model_len=256, max_num_seqs=4, memory_utilization=0.35, in_process=False)
    params = sum(p.numel() for m in actor.modules() for p in m.parameters())

    results = {"params_M": round(params / 1e6, 1)}
    cases = {"": InProcessTransport(engine), "other_process_": InProcessTransport(other)}
    for transport in cases.values():
        # Not counted: the first sync after start-up pays one-time allocations (measured ~2x a warm
        # one), which would go to whichever bucket size happened to be measured first.
        sync_weights(actor, transport, args.bucket_mb[0])
    for bucket_mb in args.bucket_mb:
        best = {}
        for _ in range(args.repeats):  # the cases take turns: a busy moment of the host hits both alike
            for prefix, transport in cases.items():
                stats = sync_weights(actor, transport, bucket_mb)
                if prefix not in best or stats.seconds < best[prefix].seconds:
                    best[prefix] = stats
        for prefix, stats in best.items():
            results[f"{prefix}sync_{bucket_mb:g}MB"] = {
                "seconds": round(stats.seconds, 3), "GB_per_s": round(stats.gb_per_s, 3), "buckets": stats.buckets,
                "bytes": stats.bytes, "engine_loader_seconds": round(stats.transport_seconds, 3),
                "message_bytes": stats.message_bytes}
    total = best[""].bytes
    memcpy_s = _memcpy_seconds(total)
    disk_dir = os.path.join(workdir, "disk")
    start = time.perf_counter()
    write_safetensors_shards(actor.iter_hf_weights(), disk_dir)
    shutil.copy(os.path.join(hf_dir, "config.json"), disk_dir)
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": disk_dir})
    engine.finish_weight_update()
    disk_s = time.perf_counter() - start
    fastest = min(v["seconds"] for k, v in results.items() if k.startswith("sync_"))
    fastest_other = min(v["seconds"] for k, v in results.items() if k.startswith("other_process_sync_"))
    results.update({
        "memcpy": {"seconds": round(memcpy_s, 4), "GB_per_s": round(total / memcpy_s / 1e9, 3)},
        "disk_save_and_reload": {"seconds": round(disk_s, 3), "GB_per_s": round(total / disk_s / 1e9, 3)},
        "sync_vs_memcpy_throughput": round(memcpy_s / fastest, 3),
        "speedup_vs_disk": round(disk_s / fastest, 2),
        "other_process_vs_in_process": round(fastest_other / fastest, 3),
    })
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    other.close()
    engine.close()
    shutil.rmtree(workdir, ignore_errors=True)
    return 0

"""`rlf-bench actor`: a Megatron actor forward+backward step vs the same step in plain transformers.

Both run in this process on the same random-weight checkpoint and batch (TP=1, fp32, CPU or
GPU); the baseline runs first, before the CPU adaptation of megatron is switched on.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time

import psutil
import torch


class PeakRSS:
    """High-water mark of this process's resident memory above the level at entry (sampled)."""

    def __enter__(self):
        self._proc = psutil.Process()
        self.start = self._proc.memory_info().rss
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def extra_mb(self) -> float:
        return (self.peak - self.start) / 2**20


def _time_steps(step, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - start) / iters


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlf-bench actor", description=__doc__)
    parser.add_argument("--model-type", default="qwen3", choices=["llama", "qwen2", "qwen3"])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)

    import transformers

    from rlfactory_megatron.models.builder import build_model_chunks
    from rlfactory_megatron.models.conversion import load_hf_weights
    from rlfactory_megatron.models.hf_arch import load_arch
    from rlfactory_megatron.models.logprobs import vocab_parallel_log_probs
    from rlfactory_megatron.models.tiny import make_tiny_hf_model
    from rlfactory_megatron.runtime.distributed import ParallelSizes, init_distributed
    from rlfactory_megatron.runtime.launch_env import ALONE

    torch.manual_seed(0)
    heads = max(args.hidden // 64, 1)
    hf_dir = tempfile.mkdtemp(prefix="rlf-bench-actor-")
    make_tiny_hf_model(args.model_type, hf_dir, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                       num_hidden_layers=args.layers, num_attention_heads=heads,
                       num_key_value_heads=max(heads // 2, 1), head_dim=64, vocab_size=args.vocab,
                       max_position_embeddings=max(args.seq, 1024))
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    tokens = args.batch * args.seq

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    hf.train()
    params = sum(p.numel() for p in hf.parameters())

    def hf_step():
        logits = hf(input_ids).logits[:, :-1]
        loss = -torch.log_softmax(logits.float(), -1).gather(-1, input_ids[:, 1:, None]).mean()
        loss.backward()
        hf.zero_grad(set_to_none=True)

    with PeakRSS() as hf_mem:
        hf_time = _time_steps(hf_step, args.warmup, args.iters)
    del hf

    init_distributed(ParallelSizes(1, 1), launch=ALONE)
    arch = load_arch(hf_dir)
    model = build_model_chunks(arch)[0]
    load_hf_weights([model], arch, hf_dir)
    position_ids = torch.arange(args.seq)[None].expand(args.batch, -1)

    def mcore_step():
        logits = model(input_ids, position_ids, None)[:, :-1]
        loss = -vocab_parallel_log_probs(logits, input_ids[:, 1:], arch.vocab_size).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)

    with PeakRSS() as mc_mem:
        mc_time = _time_steps(mcore_step, args.warmup, args.iters)

    figures = {
        "params_M": round(params / 1e6, 1), "tokens_per_step": tokens,
        "megatron_step_s": round(mc_time, 4), "transformers_step_s": round(hf_time, 4),
        "megatron_tokens_per_s": round(tokens / mc_time, 1), "transformers_tokens_per_s": round(tokens / hf_time, 1),
        "step_time_ratio_megatron_over_transformers": round(mc_time / hf_time, 3),
        "megatron_peak_extra_mb": round(mc_mem.extra_mb, 1), "transformers_peak_extra_mb": round(hf_mem.extra_mb, 1),
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0

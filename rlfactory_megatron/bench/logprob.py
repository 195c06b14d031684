"""`rlf-bench logprob`: peak memory and time of the fused log-prob/entropy vs the naive full-logits path.

Each (T, V) case runs in a fresh subprocess that times a forward+backward of both paths, one after
the other. Peak memory (bench/memory.py): on CPU VmHWM above RSS at the step's start, with glibc
told to give every freed block >= 1 MiB back at once; on CUDA torch.cuda.max_memory_allocated
above the memory allocated before the step.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from functools import partial

import torch

from rlfactory_megatron.bench.memory import RETURN_FREED_MEMORY_ENV, peak, reset_peak
from rlfactory_megatron.kernels import fused_logprob_entropy, naive_logprob_entropy

MiB = 1 << 20
TARGET_MEM_RATIO, TARGET_TIME_RATIO = 1 / 8, 1.5


def _parse(argv: list[str]) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="rlf-bench logprob", description=__doc__)
    p.add_argument("--tokens", default="1024,8192,32768", help="comma-separated T values")
    p.add_argument("--vocab", default="32768,152064", help="comma-separated V values")
    p.add_argument("--hidden", type=int, default=4096 if cuda else 128, help="H (small on CPU to keep the run short)")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--impl", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=1, help="runs per path, interleaved; the fastest counts")
    p.add_argument(
        "--max-logits-gib", type=float, default=None if cuda else 1.25,
        help="scale T down (to a power of two) so the naive [T, V] fp32 logits stay under this (CPU default 1.25; naive peak ~5x that)",
    )
    p.add_argument("--fused-beyond-cap", action="store_true", help="also run the fused path alone at the unscaled T")
    p.add_argument("--json", default=None, help="write the results to this file")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # internal: "T,V,paths" run in this process
    return p.parse_args(argv)


def _step(fn, hidden, weight, targets) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward + backward of sum(logp) + sum(entropy), the shape of an actor's training step."""
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    logp, entropy = fn(h, w, targets)
    (logp.sum() + entropy.sum()).backward()
    return logp.detach(), entropy.detach()


def _run_case(T: int, V: int, paths: list[str], args: argparse.Namespace) -> dict:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(T, args.hidden, device=device, dtype=dtype, generator=gen)
    weight = (torch.randn(V, args.hidden, device=device, generator=gen) * (2 / args.hidden**0.5)).to(dtype)
    targets = torch.randint(0, V, (T,), device=device, generator=gen)
    fns = {
        "fused": partial(fused_logprob_entropy, impl=args.impl, chunk_size=args.chunk_size),
        "naive": naive_logprob_entropy,
    }
    for name in paths:  # warm-up: thread pools, kernel compilation
        _step(fns[name], hidden[:64], weight, targets[:64])
    out, result = {}, {"T": T, "V": V, "H": args.hidden}
    best = {name: {"time_s": float("inf"), "peak_mib": 0.0} for name in paths}
    for _ in range(args.repeats):  # interleaved, so a burst of load elsewhere hits both paths alike
        for name in paths:
            base = reset_peak(device)
            start = time.perf_counter()
            out[name] = _step(fns[name], hidden, weight, targets)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best[name]["time_s"] = min(best[name]["time_s"], time.perf_counter() - start)
            best[name]["peak_mib"] = max(best[name]["peak_mib"], (peak(device) - base) / MiB)
    result.update(best)
    if len(out) == 2:
        result["max_abs_diff"] = max((a - b).abs().max().item() for a, b in zip(out["fused"], out["naive"]))
    return result


def _cases(args: argparse.Namespace) -> tuple[list[tuple[int, int, int]], list[str]]:
    """(T asked, T run, V) cases, T scaled down to keep naive logits under --max-logits-gib, and the scaled ones.

    Duplicates are dropped. A negative T run means: fused path alone at the asked T (--fused-beyond-cap).
    """
    cases, seen, scaled = [], set(), []
    for V in (int(v) for v in args.vocab.split(",")):
        for T in (int(t) for t in args.tokens.split(",")):
            run_T = T
            if args.max_logits_gib is not None:
                fit = int(args.max_logits_gib * (1 << 30) / (4 * V))
                run_T = min(T, 1 << max(fit, 1).bit_length() - 1)
            if (run_T, V) not in seen:
                seen.add((run_T, V))
                cases.append((T, run_T, V))
            if run_T != T:
                scaled.append(f"T={T} V={V} -> T={run_T}")
                if args.fused_beyond_cap:
                    cases.append((T, -T, V))
    return cases, scaled


def _spawn(T: int, V: int, paths: list[str], argv: list[str]) -> dict:
    cmd = [sys.executable, "-m", "rlfactory_megatron.bench.logprob", *argv, "--case", f"{T},{V},{'+'.join(paths)}"]
    env = {**RETURN_FREED_MEMORY_ENV, **os.environ}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"case T={T} V={V} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _row(asked: int, r: dict) -> str:
    T = f"{r['T']}" + ("" if r["T"] == asked else f" (asked {asked})")
    fused, naive = r["fused"], r.get("naive")
    if naive is None:
        return f"{T:>18} {r['V']:>7} {r['T'] * r['V'] * 4 / MiB:>11.0f} {fused['peak_mib']:>10.0f} {'-':>10} {'-':>9} {fused['time_s']:>8.2f} {'-':>8} {'-':>8}"
    return (
        f"{T:>18} {r['V']:>7} {r['T'] * r['V'] * 4 / MiB:>11.0f} {fused['peak_mib']:>10.0f} {naive['peak_mib']:>10.0f} "
        f"{naive['peak_mib'] / max(fused['peak_mib'], 1e-9):>8.1f}x {fused['time_s']:>8.2f} {naive['time_s']:>8.2f} "
        f"{fused['time_s'] / naive['time_s']:>7.2f}x"
    )


def main(argv: list[str]) -> int:
    args = _parse(argv)
    if args.case:
        T, V, paths = args.case.split(",")
        print(json.dumps(_run_case(int(T), int(V), paths.split("+"), args)))
        return 0
    print(f"rlf-bench logprob: device={args.device} H={args.hidden} dtype={args.dtype} impl={args.impl} "
          f"chunk={args.chunk_size or 'default'}; forward+backward; peak = extra memory over the inputs")
    print(f"{'T':>18} {'V':>7} {'logits MiB':>11} {'fused MiB':>10} {'naive MiB':>10} {'mem gain':>9} {'fused s':>8} {'naive s':>8} {'time':>8}")
    results = []
    cases, scaled = _cases(args)
    for asked, T, V in cases:
        r = _spawn(abs(T), V, ["fused"] if T < 0 else ["fused", "naive"], argv)
        results.append(r)
        print(_row(asked, r), flush=True)
    if scaled:
        print(f"scaled to fit --max-logits-gib {args.max_logits_gib}: {'; '.join(scaled)}")
    compared = [r for r in results if "naive" in r]
    if compared:
        big = max(compared, key=lambda r: (r["V"], r["T"]))
        speed = big["fused"]["time_s"] / big["naive"]["time_s"]
        # A tiny case's naive logits can fit in heap the process already holds: RSS then does
        # not move and there is no memory ratio to report (nor a reason to fail the run).
        if big["naive"]["peak_mib"] > 0:
            mem = big["fused"]["peak_mib"] / big["naive"]["peak_mib"]
            mem_text, mem_ok = f"{mem:.3f} x naive", mem <= TARGET_MEM_RATIO
        else:
            mem_text, mem_ok = "not measurable (naive peak below the RSS resolution; use a larger case)", False
        ok = mem_ok and speed <= TARGET_TIME_RATIO
        print(f"largest compared case T={big['T']} V={big['V']}: fused peak = {mem_text} (target <= {TARGET_MEM_RATIO}), "
              f"time = {speed:.2f} x naive (target <= {TARGET_TIME_RATIO}); max |fused - naive| = {big['max_abs_diff']:.1e}; "
              f"{'targets met' if ok else 'TARGETS MISSED'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Triton implementation of the fused log-prob steps: logits tiles are built in registers and reduced on the spot.

local_stats never writes logits: each program owns a token block and a vocab split and keeps
online-softmax stats; the splits merge like TP shards. grad_logits writes one chunk's dL/dz,
which the caller multiplies out with cuBLAS matmuls.
"""
import torch
import triton
import triton.language as tl

from rlfactory_megatron.kernels.logprob.stats import SoftmaxStats


@triton.jit
def _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w, inv_temp,
                 BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_H):
        k = k0 + tl.arange(0, BLOCK_H)
        k_ok = k < H
        h = tl.load(h_ptr + rows[:, None] * stride_h + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_w + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
    return acc * inv_temp


@triton.jit
def _stats_kernel(h_ptr, w_ptr, tgt_ptr, max_ptr, sum_ptr, shifted_ptr, target_ptr,
                  T, V, H, vocab_start, vocab_per_split, stride_h, stride_w, inv_temp,
                  BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    split = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    row_ok = rows < T
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1) - vocab_start
    run_max = tl.full((BLOCK_T,), float("-inf"), tl.float32)
    # fp64 running sums: ~1000 vocab tiles are added one after another.
    run_sum = tl.zeros((BLOCK_T,), tl.float64)
    run_shifted = tl.zeros((BLOCK_T,), tl.float64)
    target = tl.zeros((BLOCK_T,), tl.float32)
    v_begin = split * vocab_per_split
    v_end = tl.minimum(v_begin + vocab_per_split, V)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        col_ok = cols < v_end
        z = _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w, inv_temp, BLOCK_T, BLOCK_V, BLOCK_H, PRECISION)
        z = tl.where(col_ok[None, :], z, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(z, axis=1))
        scale = tl.exp(run_max - new_max).to(tl.float64)
        shift = tl.where(run_sum > 0, run_max - new_max, 0.0).to(tl.float64)  # first tile: avoid (-inf) * 0
        zs = tl.where(col_ok[None, :], z - new_max[:, None], 0.0)
        e = tl.where(col_ok[None, :], tl.exp(zs), 0.0)
        run_shifted = (run_shifted + shift * run_sum) * scale + tl.sum(e * zs, axis=1).to(tl.float64)
        run_sum = run_sum * scale + tl.sum(e, axis=1).to(tl.float64)
        run_max = new_max
        target += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
    out = split * T + rows
    tl.store(max_ptr + out, run_max, mask=row_ok)
    tl.store(sum_ptr + out, run_sum, mask=row_ok)
    tl.store(shifted_ptr + out, run_shifted, mask=row_ok)
    tl.store(target_ptr + out, target, mask=row_ok)


@triton.jit
def _grad_logits_kernel(h_ptr, w_ptr, tgt_ptr, logz_ptr, mean_ptr, glp_ptr, gent_ptr, dz_ptr,
                        T, V, H, vocab_start, stride_h, stride_w, inv_temp,
                        BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V).to(tl.int64)
    row_ok, col_ok = rows < T, cols < V
    z = _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w, inv_temp, BLOCK_T, BLOCK_V, BLOCK_H, PRECISION)
    log_z = tl.load(logz_ptr + rows, mask=row_ok, other=0.0)
    mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
    g_lp = tl.load(glp_ptr + rows, mask=row_ok, other=0.0)
    g_ent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0)
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1) - vocab_start
    p = tl.exp(z - log_z[:, None])
    dz = -p * (g_lp[:, None] + g_ent[:, None] * (z - mean[:, None]))
    dz += tl.where(cols[None, :] == tgt[:, None], g_lp[:, None], 0.0)
    tl.store(dz_ptr + rows[:, None] * V + cols[None, :], dz, mask=row_ok[:, None] & col_ok[None, :])


def _config(hidden: torch.Tensor) -> dict:
    # fp32 inputs must not silently drop to tf32 in tl.dot: the fp32 path promises 1e-5 agreement.
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    if hidden.device.type == "cpu":  # TRITON_INTERPRET=1: small tiles keep the interpreter quick
        return dict(BLOCK_T=16, BLOCK_V=32, BLOCK_H=16, PRECISION=precision)
    return dict(BLOCK_T=64, BLOCK_V=128, BLOCK_H=64, PRECISION=precision, num_warps=8)


def _vocab_splits(n_token_blocks: int, n_vocab_blocks: int, device: torch.device) -> int:
    # Enough programs to fill the GPU when T is short; each split still spans whole vocab blocks.
    programs = 4 * (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1)
    return max(1, min(n_vocab_blocks, triton.cdiv(programs, n_token_blocks)))


def local_stats(hidden, weight, targets, vocab_start, inv_temp, chunk_size) -> SoftmaxStats:
    """Softmax stats of this rank's vocab shard; `chunk_size` is unused (no logits are stored)."""
    T, H = hidden.shape
    V = weight.shape[0]
    cfg = _config(hidden)
    n_t = triton.cdiv(T, cfg["BLOCK_T"])
    n_v = triton.cdiv(V, cfg["BLOCK_V"])
    if hidden.device.type == "cpu":
        splits = min(n_v, 2)  # exercise the split merge in interpreter tests too
    else:
        splits = _vocab_splits(n_t, n_v, hidden.device)
    per_split = triton.cdiv(n_v, splits) * cfg["BLOCK_V"]
    splits = triton.cdiv(V, per_split)
    out = torch.empty(4, splits, T, dtype=torch.float64, device=hidden.device)
    _stats_kernel[(n_t, splits)](
        hidden, weight, targets, out[0], out[1], out[2], out[3],
        T, V, H, vocab_start, per_split, hidden.stride(0), weight.stride(0), inv_temp, **cfg,
    )
    return SoftmaxStats(*out).merged(0)


def grad_logits(hidden, weight, targets, log_z, mean_logit, grad_logp, grad_entropy, vocab_start, inv_temp):
    """dL/dz [C, V/tp] for one token chunk, recomputing its logits tile by tile."""
    T, H = hidden.shape
    V = weight.shape[0]
    cfg = _config(hidden)
    dz = torch.empty(T, V, dtype=torch.float32, device=hidden.device)
    grid = (triton.cdiv(T, cfg["BLOCK_T"]), triton.cdiv(V, cfg["BLOCK_V"]))
    _grad_logits_kernel[grid](
        hidden, weight, targets, log_z.contiguous(), mean_logit.contiguous(),
        grad_logp.contiguous(), grad_entropy.contiguous(), dz,
        T, V, H, vocab_start, hidden.stride(0), weight.stride(0), inv_temp, **cfg,
    )
    return dz

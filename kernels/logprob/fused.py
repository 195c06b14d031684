"""Fused linear log-prob + entropy over a (vocab-parallel) output layer, with a recomputing backward.

Forward keeps O(T) per-token stats; backward recomputes each token chunk's logits, so peak
extra memory is O(chunk x V/tp) whatever T is. The per-chunk math comes from a backend
(PyTorch or Triton) looked up by name; chunking, TP reductions and autograd live here once.
"""
import importlib
import math
from types import ModuleType

import torch
import torch.distributed as dist

from rlfactory_megatron.kernels.logprob.stats import SoftmaxStats
from rlfactory_megatron.registry import Registry

# Backend name -> module providing local_stats() and grad_logits(); imported on first use
# so that CPU-only runs never import triton.
BACKENDS: Registry[str] = Registry("log-prob kernel backend")
BACKENDS.register("torch", "rlfactory_megatron.kernels.logprob.torch_backend")
BACKENDS.register("triton", "rlfactory_megatron.kernels.logprob.triton_backend")

# Default chunk: about 2^25 fp32 logits (128 MiB) per [chunk, V/tp] buffer; smaller chunks slow the matmuls.
CHUNK_ELEMENTS = 1 << 25


def get_backend(impl: str, device: torch.device) -> ModuleType:
    if impl == "auto":
        impl = "triton" if device.type == "cuda" else "torch"
    if impl not in BACKENDS:
        raise ValueError(f"impl must be 'auto' or one of {sorted(BACKENDS)}, got '{impl}'")
    return importlib.import_module(BACKENDS.get(impl))


def default_chunk_size(vocab_shard: int) -> int:
    return max(16, CHUNK_ELEMENTS // vocab_shard // 16 * 16)


# On CPU, MKL runs a product with a handful of rows as a gemv that sums the ~150k-long vocab
# axis term after term (1e-5 relative error); 16 rows keep it on the blocked gemm.
MIN_CPU_GEMM_ROWS = 16


def _hidden_grad(dz: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    rows = dz.shape[0]
    if dz.device.type != "cpu" or rows >= MIN_CPU_GEMM_ROWS:
        return dz @ weight
    padded = dz.new_zeros(MIN_CPU_GEMM_ROWS, dz.shape[1])
    padded[:rows] = dz
    return (padded @ weight)[:rows]


def _vocab_start(weight: torch.Tensor, tp_group: dist.ProcessGroup | None) -> int:
    # Megatron's vocab-parallel layers give rank r the rows [r * V/tp, (r + 1) * V/tp).
    return 0 if tp_group is None else dist.get_rank(tp_group) * weight.shape[0]


def _real_rows(weight: torch.Tensor, vocab_start: int, vocab_size: int | None) -> int:
    """How many leading rows of this shard are real tokens; the rest is vocab padding."""
    if vocab_size is None:
        return weight.shape[0]
    return max(0, min(weight.shape[0], vocab_size - vocab_start))


class _FusedLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, tp_group, inv_temp, chunk_size, backend, vocab_size):
        vocab_start = _vocab_start(weight, tp_group)
        real = _real_rows(weight, vocab_start, vocab_size)
        if real:
            stats = backend.local_stats(hidden, weight[:real], targets, vocab_start, inv_temp, chunk_size)
        else:
            stats = SoftmaxStats.empty(hidden.shape[0], hidden.device)
        logp, entropy, log_z, mean_logit = stats.all_reduced(tp_group).finalize()
        ctx.save_for_backward(hidden, weight, targets, log_z, mean_logit)
        ctx.config = (tp_group, inv_temp, chunk_size, backend, vocab_start, real)
        return logp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, log_z, mean_logit = ctx.saved_tensors
        tp_group, inv_temp, chunk_size, backend, vocab_start, real = ctx.config
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        real_weight = weight[:real]
        # Zeros: a shard that is all padding contributes nothing and skips the loop.
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        # fp32 accumulation over chunks; for an fp32 weight this is the output itself. Padding rows keep 0.
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        for start in range(0, hidden.shape[0] if real else 0, chunk_size):
            rows = slice(start, start + chunk_size)
            h = hidden[rows]
            dz = backend.grad_logits(
                h, real_weight, targets[rows], log_z[rows], mean_logit[rows],
                grad_logp[rows].float(), grad_entropy[rows].float(), vocab_start, inv_temp,
            )
            if need_hidden:
                grad_hidden[rows] = _hidden_grad(dz.to(weight.dtype), real_weight).mul_(inv_temp)
            if need_weight:
                grad_weight[:real].addmm_(dz.t(), h.float(), alpha=inv_temp)
        if need_hidden and tp_group is not None and dist.get_world_size(tp_group) > 1:
            # As Megatron's column-parallel output layer: each rank saw only its vocab shard.
            dist.all_reduce(grad_hidden, group=tp_group)
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def fused_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    impl: str = "auto",
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `targets` and entropy under softmax(hidden @ weight.T / temperature), in fp32.

    hidden [..., H]; weight [V/tp, H], this rank's vocab shard of `tp_group` (None: the whole
    vocab); targets [...] global token ids. Returns (logp, entropy), each shaped like targets.
    Differentiable w.r.t. hidden and weight; the hidden-grad is all-reduced over `tp_group`.
    vocab_size: the real vocabulary when the weight's rows are padded (megatron pads V to split
    it over TP); rows at global index >= vocab_size get no probability and zero gradient.
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} must be hidden's leading shape {tuple(hidden.shape[:-1])}")
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden size {hidden.shape[-1]} != weight's {weight.shape[-1]} (weight is [V/tp, H])")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a positive number, got {temperature}")
    if vocab_size is not None and vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1 (the real, unpadded vocabulary), got {vocab_size}")
    backend = get_backend(impl, hidden.device)
    chunk = default_chunk_size(weight.shape[0]) if chunk_size is None else chunk_size
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    logp, entropy = _FusedLogprobEntropy.apply(
        flat_hidden, weight.contiguous(), targets.reshape(-1), tp_group, 1.0 / temperature, chunk, backend, vocab_size
    )
    return logp.view(targets.shape), entropy.view(targets.shape)

"""Reductions over the valid (mask = 1) entries of a tensor.

Masked entries are dropped with `torch.where`, not multiplied by 0, so that inf/nan
values sitting on masked tokens can neither leak into results nor into gradients.
"""
import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    kept = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over valid entries; 0 where there are none (instead of nan)."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over valid entries (unbiased variance); masked entries become 0."""
    mean = masked_mean(values, mask)
    centered = torch.where(mask.bool(), values - mean, torch.zeros((), dtype=values.dtype, device=values.device))
    count = mask.bool().sum()
    var = centered.square().sum() / (count - 1).clamp(min=1)
    return centered * torch.rsqrt(var + eps)

"""Reductions over the valid (mask = 1) entries of a tensor.

Masked entries are dropped with `torch.where`, not multiplied by 0, so that inf/nan
values sitting on masked tokens can neither leak into results nor into gradients.
"""
import torch
import torch.distributed as dist


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    kept = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over valid entries; 0 where there are none (instead of nan)."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, group=None) -> torch.Tensor:
    """(x - mean) / std over valid entries (unbiased variance); masked entries become 0. With a
    process `group`, the statistics are those of the valid entries of all its ranks together
    (each rank holding some rows of one batch)."""
    total = torch.stack([masked_sum(values, mask).double(), mask.bool().sum().double()])
    _all_reduce(total, group)
    mean = (total[0] / total[1].clamp(min=1)).to(values.dtype)
    centered = torch.where(mask.bool(), values - mean, torch.zeros((), dtype=values.dtype, device=values.device))
    square = centered.double().square().sum()
    _all_reduce(square, group)
    var = (square / (total[1] - 1).clamp(min=1)).to(values.dtype)
    return centered * torch.rsqrt(var + eps)


def _all_reduce(tensor: torch.Tensor, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, group=group)

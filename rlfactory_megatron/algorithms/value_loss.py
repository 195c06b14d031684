"""Clipped value (critic) loss."""
from dataclasses import dataclass

import torch

from rlfactory_megatron.algorithms.aggregation import aggregate_loss
from rlfactory_megatron.algorithms.masked import masked_mean


@dataclass
class ValueLoss:
    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]  # detached: vf_clip_frac


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_range: float = 0.2,
    agg_mode: str = "token-mean",
    **agg_options,
) -> ValueLoss:
    """0.5 * max((v - R)^2, (clip(v, v_old ± eps) - R)^2) per token, aggregated over valid tokens."""
    valid = mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    # where() on every input: nothing on a masked token can reach the loss or its gradient.
    v = torch.where(valid, values, zero)
    v_old = torch.where(valid, old_values, zero)
    ret = torch.where(valid, returns, zero)
    v_clipped = v_old + (v - v_old).clamp(-clip_range, clip_range)
    unclipped, clipped = (v - ret).square(), (v_clipped - ret).square()
    loss = 0.5 * torch.maximum(unclipped, clipped)
    metrics = {"vf_clip_frac": masked_mean((clipped > unclipped).float(), mask).detach()}
    return ValueLoss(aggregate_loss(loss, mask, agg_mode, **agg_options), metrics)

"""Policy-gradient losses (PPO clip and its dual-clip / clip-higher variants, GSPO), registered by name.

Shared signature: `fn(log_prob, old_log_prob, advantages, mask, *, clip_low, clip_high,
clip_ratio_c, agg_mode) -> PolicyLoss`; inputs on masked tokens never reach the loss or its gradient.
"""
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from rlfactory_megatron.algorithms.aggregation import aggregate_loss
from rlfactory_megatron.algorithms.masked import masked_mean
from rlfactory_megatron.registry import Registry

# exp() of a larger log-ratio overflows fp32 long before it could be a sensible update.
MAX_LOG_RATIO = 20.0


@dataclass
class PolicyLoss:
    loss: torch.Tensor  # scalar, differentiable w.r.t. log_prob
    metrics: dict[str, torch.Tensor]  # detached scalars: clip_frac, approx_kl, ...


PolicyLossFn = Callable[..., PolicyLoss]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


def masked_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # where() before exp(): a masked token's ratio is exactly 1 and its gradient exactly 0, whatever its inputs.
    diff = torch.where(mask.bool(), log_prob - old_log_prob, torch.zeros((), dtype=log_prob.dtype, device=log_prob.device))
    return diff.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def _clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token -min(r A, clip(r) A), with the dual-clip bound -c A for negative advantages."""
    adv = torch.where(mask.bool(), advantages, torch.zeros((), dtype=advantages.dtype, device=advantages.device))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {"clip_frac": masked_mean((clipped > unclipped).float(), mask).detach()}
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 (dual-clip lower bound), got {clip_ratio_c}")
        bound = -adv * clip_ratio_c
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        metrics["dual_clip_frac"] = masked_mean(dual.float(), mask).detach()
    return loss, metrics


@POLICY_LOSSES.register("ppo")
def ppo_clip_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    clip_ratio_c: float | None = None,
    agg_mode: str = "token-mean",
    **agg_options,
) -> PolicyLoss:
    """PPO clipped surrogate with token-level ratios.

    `clip_high` > `clip_low` is DAPO's clip-higher (default: symmetric); `clip_ratio_c`
    turns on dual-clip, bounding the loss of negative-advantage tokens at -c * A.
    """
    log_ratio = masked_log_ratio(log_prob, old_log_prob, mask)
    ratio = log_ratio.exp()
    high = clip_low if clip_high is None else clip_high
    loss, metrics = _clipped_surrogate(ratio, advantages, mask, clip_low, high, clip_ratio_c)
    metrics["approx_kl"] = masked_mean(-log_ratio, mask).detach()
    return PolicyLoss(aggregate_loss(loss, mask, agg_mode, **agg_options), metrics)


POLICY_LOSSES.register("dual-clip", partial(ppo_clip_loss, clip_ratio_c=3.0))
POLICY_LOSSES.register("clip-higher", partial(ppo_clip_loss, clip_low=0.2, clip_high=0.28))


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float | None = 4e-4,
    clip_ratio_c: float | None = None,
    agg_mode: str = "seq-mean-token-mean",
    **agg_options,
) -> PolicyLoss:
    """GSPO: one ratio per sequence, exp(mean token log-ratio), clipped with tight bounds.

    Token t carries ratio sg(s_i) * exp(logp_t - sg(logp_t)): its value is the sequence
    ratio s_i and its gradient s_i * grad logp_t, which averages to GSPO's sequence gradient.
    """
    log_ratio = masked_log_ratio(log_prob, old_log_prob, mask)
    seq_log_ratio = log_ratio.sum(-1) / mask.bool().sum(-1).clamp(min=1)
    token_log_prob = torch.where(mask.bool(), log_prob, torch.zeros((), dtype=log_prob.dtype, device=log_prob.device))
    ratio = (seq_log_ratio.detach()[:, None] + token_log_prob - token_log_prob.detach()).exp()
    high = clip_low if clip_high is None else clip_high
    loss, metrics = _clipped_surrogate(ratio, advantages, mask, clip_low, high, clip_ratio_c)
    metrics["approx_kl"] = masked_mean(-log_ratio, mask).detach()
    return PolicyLoss(aggregate_loss(loss, mask, agg_mode, **agg_options), metrics)


def compute_policy_loss(
    name: str, log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, **options
) -> PolicyLoss:
    """Look up the policy loss `name` and run it."""
    return POLICY_LOSSES.get(name)(log_prob, old_log_prob, advantages, mask, **options)

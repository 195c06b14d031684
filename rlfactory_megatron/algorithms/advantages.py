"""Advantage estimators (GAE, GRPO, Dr.GRPO, RLOO, REINFORCE++), registered by name.

All share one signature so the trainer can call any of them from config:
`fn(token_rewards [B, L], mask [B, L], *, values, group_index, gamma, lam, dp_group) -> Advantages`.
Estimators ignore the inputs they do not use; masked tokens get advantage and return 0,
and whatever sits on them (rewards, values) never influences valid tokens. With `dp_group`,
each of its ranks holds some rows of one batch (a group's samples may sit on several): group
statistics and whitening are those of the whole batch, each rank gets its rows' advantages.
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlfactory_megatron.algorithms.masked import masked_sum, masked_whiten
from rlfactory_megatron.registry import Registry


@dataclass
class Advantages:
    advantages: torch.Tensor  # [B, L], 0 on masked tokens
    returns: torch.Tensor  # [B, L], the critic's regression target (= advantages for critic-free estimators)


AdvantageEstimator = Callable[..., Advantages]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")

GROUP_STD_EPS = 1e-6


def _require(value: torch.Tensor | None, name: str, estimator: str) -> torch.Tensor:
    if value is None:
        raise ValueError(f"advantage estimator '{estimator}' needs `{name}`")
    return value


def _zero_masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _zero_masked(per_seq[:, None].expand(mask.shape), mask)


def _pooled(per_row: torch.Tensor, dp_group) -> tuple[torch.Tensor, slice]:
    """`per_row` of every rank of `dp_group` concatenated in rank order (rows are few: one number
    each), and the slice of it that is this rank's."""
    if dp_group is None or dist.get_world_size(dp_group) == 1:
        return per_row, slice(0, len(per_row))
    parts: list = [None] * dist.get_world_size(dp_group)
    dist.all_gather_object(parts, per_row.cpu(), group=dp_group)
    start = sum(len(part) for part in parts[: dist.get_rank(dp_group)])
    return torch.cat(parts).to(per_row.device), slice(start, start + len(per_row))


def _group_stats(scores: torch.Tensor, group_index: torch.Tensor,
                 dp_group=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group size, group mean, unbiased group std) of `scores` grouped by `group_index`,
    in float64: a float32 mean of equal scores such as 0.9 can be one ulp off, which the std
    division (std ~6e-8 against eps 1e-6) blows up to advantages of +-0.06 for a group that should
    teach nothing. In float64 the sum of up to 2**29 equal float32 scores is exact, so is the mean."""
    scores, mine = _pooled(scores.double(), dp_group)
    group_index, _ = _pooled(group_index, dp_group)
    _, inverse = torch.unique(group_index, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    size = torch.bincount(inverse, minlength=n_groups).to(scores.dtype)
    mean = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, inverse, scores) / size
    sq_dev = (scores - mean[inverse]).square()
    var = torch.zeros_like(mean).index_add_(0, inverse, sq_dev) / (size - 1).clamp(min=1)
    inverse = inverse[mine]
    return size[inverse], mean[inverse], var.sqrt()[inverse]


def _uniform_group(scores: torch.Tensor, group_index: torch.Tensor, dp_group=None) -> torch.Tensor:
    """[B] bool: the sample's group (of two or more) scored all alike; its advantage is exactly 0."""
    scores, mine = _pooled(scores.double(), dp_group)
    group_index, _ = _pooled(group_index, dp_group)
    _, inverse = torch.unique(group_index, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    low = torch.full((n_groups,), float("inf"), dtype=scores.dtype).scatter_reduce(0, inverse, scores, "amin")
    high = torch.full((n_groups,), float("-inf"), dtype=scores.dtype).scatter_reduce(0, inverse, scores, "amax")
    size = torch.bincount(inverse, minlength=n_groups)
    return ((low == high) & (size > 1))[inverse[mine]]


def _reverse_scan(step, mask: torch.Tensor, *carry: torch.Tensor) -> torch.Tensor:
    """Run `step(t, *carry) -> (output, *new_carry)` from the last token to the first.

    On masked tokens the carry passes through unchanged and the output is 0, so a
    tool-observation span in the middle of a response is skipped, not a sequence end.
    """
    valid = mask.bool()
    out = torch.zeros(mask.shape, dtype=carry[0].dtype, device=mask.device)
    for t in reversed(range(mask.shape[1])):
        output, *new_carry = step(t, *carry)
        carry = tuple(torch.where(valid[:, t], new, old) for new, old in zip(new_carry, carry))
        out[:, t] = torch.where(valid[:, t], output, torch.zeros_like(output))
    return out


@ADVANTAGE_ESTIMATORS.register("gae")
@torch.no_grad()
def gae(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    dp_group=None,
) -> Advantages:
    """Generalized advantage estimation over valid tokens; advantages whitened over the batch."""
    values = _require(values, "values", "gae")
    rewards, values = _zero_masked(token_rewards, mask), _zero_masked(values, mask)
    zeros = torch.zeros(mask.shape[0], dtype=values.dtype, device=values.device)

    def step(t, next_value, next_gae):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * next_gae
        return gae_t, values[:, t], gae_t

    raw = _reverse_scan(step, mask, zeros, zeros)
    returns = _zero_masked(raw + values, mask)
    return Advantages(masked_whiten(raw, mask, group=dp_group), returns)


def _grpo(
    token_rewards: torch.Tensor, mask: torch.Tensor, group_index: torch.Tensor | None, *, norm_by_std: bool, name: str,
    dp_group=None,
) -> Advantages:
    group_index = _require(group_index, "group_index", name)
    scores = masked_sum(token_rewards, mask, dim=-1)
    size, mean, std = _group_stats(scores, group_index, dp_group)
    # A group of one has no baseline: its score is used as is (mean 0, std 1).
    singleton = size <= 1
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    std = torch.where(singleton, torch.ones_like(std), std)
    adv = scores.double() - mean
    if norm_by_std:
        adv = adv / (std + GROUP_STD_EPS)
    adv = torch.where(_uniform_group(scores, group_index, dp_group), torch.zeros_like(adv), adv)
    adv = _broadcast(adv.to(scores.dtype), mask)
    return Advantages(adv, adv)


@ADVANTAGE_ESTIMATORS.register("grpo")
@torch.no_grad()
def grpo(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    dp_group=None,
) -> Advantages:
    """(score - group mean) / (group std + eps), score = sum of the sequence's token rewards."""
    return _grpo(token_rewards, mask, group_index, norm_by_std=True, name="grpo", dp_group=dp_group)


@ADVANTAGE_ESTIMATORS.register("drgrpo")
@torch.no_grad()
def drgrpo(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    dp_group=None,
) -> Advantages:
    """Dr.GRPO: score - group mean, without the std division (pair with seq-mean-token-sum-norm)."""
    return _grpo(token_rewards, mask, group_index, norm_by_std=False, name="drgrpo", dp_group=dp_group)


@ADVANTAGE_ESTIMATORS.register("rloo")
@torch.no_grad()
def rloo(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    dp_group=None,
) -> Advantages:
    """Leave-one-out baseline: score - mean of the other samples of its group."""
    group_index = _require(group_index, "group_index", "rloo")
    scores = masked_sum(token_rewards, mask, dim=-1)
    size, mean, _ = _group_stats(scores, group_index, dp_group)
    wide = scores.double()
    others_mean = (mean * size - wide) / (size - 1).clamp(min=1)
    adv = torch.where(size > 1, wide - others_mean, wide)
    adv = torch.where(_uniform_group(scores, group_index, dp_group), torch.zeros_like(adv), adv)
    adv = _broadcast(adv.to(scores.dtype), mask)
    return Advantages(adv, adv)


@ADVANTAGE_ESTIMATORS.register("reinforce++")
@torch.no_grad()
def reinforce_plus_plus(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    dp_group=None,
) -> Advantages:
    """Discounted return-to-go of the token rewards, whitened over the batch."""
    rewards = _zero_masked(token_rewards, mask)

    def step(t, next_return):
        ret = rewards[:, t] + gamma * next_return
        return ret, ret

    returns = _reverse_scan(step, mask, torch.zeros(mask.shape[0], dtype=rewards.dtype, device=rewards.device))
    return Advantages(masked_whiten(returns, mask, group=dp_group), returns)


@ADVANTAGE_ESTIMATORS.register("reinforce++-baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    dp_group=None,
) -> Advantages:
    """score - group mean, broadcast to tokens, then whitened over the batch."""
    centered = _grpo(token_rewards, mask, group_index, norm_by_std=False, name="reinforce++-baseline",
                     dp_group=dp_group).advantages
    adv = masked_whiten(centered, mask, group=dp_group)
    # Whitening shifts every row by the batch mean; a group that scored all alike stays at 0.
    uniform = _uniform_group(masked_sum(token_rewards, mask, dim=-1), group_index, dp_group)
    adv = torch.where(uniform[:, None], torch.zeros_like(adv), adv)
    return Advantages(adv, adv)


def compute_advantages(name: str, token_rewards: torch.Tensor, mask: torch.Tensor, **inputs) -> Advantages:
    """Look up the estimator `name` and run it."""
    return ADVANTAGE_ESTIMATORS.get(name)(token_rewards, mask, **inputs)

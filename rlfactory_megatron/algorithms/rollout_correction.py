"""Off-policy correction for the gap between the policy the engine sampled from and the trainer's.

The engines' log-probs of the tokens they sampled (`rollout/logprob_gap_*` measures them
against the trainer's) differ from the trainer's whenever the two do not compute the same
policy: bf16 kernels on GPU, a sync that lagged, an engine at another temperature, or (with
asynchronous rollout) weights some updates old. Two corrections, each off unless configured
(`actor.rollout_correction`):
- token-level truncated importance sampling: token t's policy-gradient term is weighted by
  min(pi_trainer(t) / pi_engine(t), tis_cap), detached (the ratio the samples' own
  distribution calls for, capped so that one token cannot dominate a step);
- sequence-level masking: a sample whose geometric-mean ratio exp(mean_t log(pi_trainer /
  pi_engine)) leaves [mask_low, mask_high] is left out of the loss altogether: it was sampled
  from a policy too far from the one being trained for any weight to repair it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlfactory_megatron.algorithms.policy_losses import masked_log_ratio


# The token IS cap when the correction is on without one (asynchronous RL's default; verl's too).
DEFAULT_TIS_CAP = 2.0


def correction_settings(correction, asynchronous: bool) -> dict[str, float]:
    """`rollout_correction`'s keyword arguments from `actor.rollout_correction` ({} when off):
    on by default in asynchronous RL, where the engines sample from weights some updates old."""
    settings = {k: correction[k] for k in ("tis_cap", "mask_low", "mask_high") if correction[k] is not None}
    enabled = correction["enable"]
    if enabled is False or (enabled is None and not settings and not asynchronous):
        return {}
    return settings or {"tis_cap": DEFAULT_TIS_CAP}


@dataclass
class RolloutCorrection:
    token_weights: torch.Tensor  # [B, T], detached; 0 off the mask
    keep: torch.Tensor  # [B] bool: the rows left in the loss
    log_ratio: torch.Tensor  # [B, T] log(pi_trainer / pi_engine) on the mask, 0 elsewhere

    def apply(self, advantages: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages x token weights, loss mask without the masked rows). For PPO's clipped
        surrogate, scaling A_t by w_t >= 0 scales the token's loss by w_t exactly:
        max(-wA r, -wA clip(r)) = w max(-A r, -A clip(r))."""
        mask = loss_mask * self.keep[:, None].to(loss_mask.dtype)
        return advantages * self.token_weights, mask


def rollout_correction(trainer_log_probs: torch.Tensor, engine_log_probs: torch.Tensor, mask: torch.Tensor, *,
                       tis_cap: float | None = None, mask_low: float | None = None,
                       mask_high: float | None = None) -> RolloutCorrection:
    """The weights and the row mask for one batch ([B, T] log-probs of the sampled tokens, `mask`
    1 on trained tokens). With every option None: weights 1 on the mask, every row kept."""
    on = mask.bool()
    log_ratio = masked_log_ratio(trainer_log_probs.detach(), engine_log_probs, mask)
    weights = log_ratio.exp().clamp(max=tis_cap) if tis_cap is not None else torch.ones_like(log_ratio)
    weights = torch.where(on, weights, torch.zeros_like(weights))
    tokens = on.sum(-1)
    seq_ratio = (log_ratio.sum(-1) / tokens.clamp(min=1)).exp()
    keep = torch.ones(len(mask), dtype=torch.bool, device=mask.device)
    if mask_low is not None:
        keep &= seq_ratio >= mask_low
    if mask_high is not None:
        keep &= seq_ratio <= mask_high
    keep |= tokens == 0  # nothing of it is trained either way
    return RolloutCorrection(weights, keep, log_ratio)

"""KL penalty estimators between the policy and the reference model (k1, k2, k3), registered by name.

Each returns the per-token penalty [B, L], 0 on masked tokens (gradient through them exactly 0);
aggregate it with `aggregate_loss` for a KL loss, or subtract beta * it from token rewards.
"""
from collections.abc import Callable

import torch

from rlfactory_megatron.registry import Registry

KLPenalty = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
KL_PENALTIES: Registry[KLPenalty] = Registry("KL penalty")

# k3 explodes when the reference assigns a token far higher probability than the policy.
K3_CLAMP = 10.0


def _masked_log_ratio(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    return torch.where(mask.bool(), log_prob - ref_log_prob, zero)


@KL_PENALTIES.register("k1")
def kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log p - log p_ref: unbiased, high variance, can be negative per token."""
    return _masked_log_ratio(log_prob, ref_log_prob, mask)


@KL_PENALTIES.register("k2")
def kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """0.5 * (log p - log p_ref)^2: biased, low variance, gradient of the true KL to first order."""
    return 0.5 * _masked_log_ratio(log_prob, ref_log_prob, mask).square()


@KL_PENALTIES.register("k3")
def kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10]: unbiased, low variance, >= 0."""
    neg = -_masked_log_ratio(log_prob, ref_log_prob, mask)
    return (neg.exp() - neg - 1.0).clamp(-K3_CLAMP, K3_CLAMP)


KL_PENALTIES.register("low-var-kl", kl_k3)


def kl_penalty(name: str, log_prob: torch.Tensor, ref_log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Look up the KL estimator `name` and return its per-token penalty."""
    return KL_PENALTIES.get(name)(log_prob, ref_log_prob, mask)

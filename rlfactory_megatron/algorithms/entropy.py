"""Entropy bonus: rewards the policy for keeping its token distribution spread."""
import torch

from rlfactory_megatron.algorithms.aggregation import aggregate_loss


def entropy_bonus(
    entropy: torch.Tensor, mask: torch.Tensor, coef: float, *, agg_mode: str = "token-mean"
) -> torch.Tensor:
    """The term to add to the loss: -coef * aggregated entropy of the valid tokens."""
    return -coef * aggregate_loss(entropy, mask, agg_mode)

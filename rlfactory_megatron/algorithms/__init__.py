"""RL algorithms as pure tensor functions; the trainer looks them up by name in one registry per kind."""
from rlfactory_megatron.algorithms.advantages import ADVANTAGE_ESTIMATORS, Advantages, compute_advantages
from rlfactory_megatron.algorithms.aggregation import LOSS_AGGREGATIONS, aggregate_loss
from rlfactory_megatron.algorithms.entropy import entropy_bonus
from rlfactory_megatron.algorithms.kl import KL_PENALTIES, kl_penalty
from rlfactory_megatron.algorithms.masked import masked_mean, masked_sum, masked_whiten
from rlfactory_megatron.algorithms.policy_losses import POLICY_LOSSES, PolicyLoss, compute_policy_loss
from rlfactory_megatron.registry import Registry
from rlfactory_megatron.algorithms.value_loss import ValueLoss, clipped_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_PENALTIES",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "Advantages",
    "PolicyLoss",
    "Registry",
    "ValueLoss",
    "aggregate_loss",
    "clipped_value_loss",
    "compute_advantages",
    "compute_policy_loss",
    "entropy_bonus",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
]

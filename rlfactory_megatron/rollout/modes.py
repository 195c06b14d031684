"""The rollout modes (`rollout.mode`): where the engines live, and the weight-sync transport that reaches them."""
from __future__ import annotations

from dataclasses import dataclass

from rlfactory_megatron.registry import Registry


@dataclass(frozen=True)
class RolloutMode:
    transport: str  # the one name in TRANSPORTS that can feed its engines (what weight_sync.transport=auto means)


ROLLOUT_MODES: Registry[RolloutMode] = Registry("rollout mode")
# A colocated engine lives in a training process, so its weights go straight to its loader.
ROLLOUT_MODES.register("colocated", RolloutMode(transport="in_process"))
# Disaggregated engines (Ray actors on devices of their own) take them through one broadcast
# group with the sending rank.
ROLLOUT_MODES.register("disaggregated", RolloutMode(transport="broadcast"))

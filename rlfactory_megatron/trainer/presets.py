"""What each `trainer.algorithm` means: advantage estimator, policy loss, critic, extras."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AlgorithmPreset:
    advantage: str
    policy_loss: str
    use_critic: bool = False
    drop_uniform_groups: bool = False  # DAPO dynamic sampling: all-equal-reward groups teach nothing


ALGORITHM_PRESETS: dict[str, AlgorithmPreset] = {
    "ppo": AlgorithmPreset("gae", "ppo", use_critic=True),
    "grpo": AlgorithmPreset("grpo", "ppo"),
    "dapo": AlgorithmPreset("grpo", "clip-higher", drop_uniform_groups=True),
    "gspo": AlgorithmPreset("grpo", "gspo"),
    "reinforce_pp": AlgorithmPreset("reinforce++", "ppo"),
    "rloo": AlgorithmPreset("rloo", "ppo"),
}

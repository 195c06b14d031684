"""What each `trainer.algorithm` means: advantage estimator, policy loss, critic, extras."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf, open_dict

from rlfactory_megatron.registry import Registry


@dataclass(frozen=True)
class AlgorithmPreset:
    advantage: str
    policy_loss: str
    use_critic: bool = False
    drop_uniform_groups: bool = False  # DAPO dynamic sampling: all-equal-reward groups teach nothing
    # Settings the algorithm implies; applied at load where the user set no value, so anything
    # the user sets wins.
    implied: tuple[tuple[str, Any], ...] = ()


ALGORITHM_PRESETS: Registry[AlgorithmPreset] = Registry("algorithm preset")
ALGORITHM_PRESETS.register("ppo", AlgorithmPreset("gae", "ppo", use_critic=True))
ALGORITHM_PRESETS.register("grpo", AlgorithmPreset("grpo", "ppo"))
# DAPO: clip-higher (eps_high 0.28), dynamic sampling, overlong penalty over the last quarter
# of the response budget (and token-mean loss aggregation, already the default).
ALGORITHM_PRESETS.register("dapo", AlgorithmPreset("grpo", "clip-higher", drop_uniform_groups=True, implied=(
    ("actor.clip_ratio_high", 0.28), ("reward.manager", "dapo"))))
ALGORITHM_PRESETS.register("gspo", AlgorithmPreset("grpo", "gspo"))
ALGORITHM_PRESETS.register("reinforce_pp", AlgorithmPreset("reinforce++", "ppo"))
ALGORITHM_PRESETS.register("rloo", AlgorithmPreset("rloo", "ppo"))


def apply_preset(cfg, user_set: set[str]) -> list[str]:
    """The preset of `cfg.trainer.algorithm` written into `cfg` (at load, once): its policy loss and
    implied settings where the user set no value (`user_set`: the dotted keys the config file or
    the overrides gave), so `trainer.algorithm=grpo actor.policy_loss=dual-clip` trains with
    dual-clip. Returns the `key=value` strings it applied (for the start-up log)."""
    preset = ALGORITHM_PRESETS.get(cfg.trainer.algorithm)
    applied = []
    with open_dict(cfg):
        for key, value in (("actor.policy_loss", preset.policy_loss), *preset.implied):
            if key not in user_set and OmegaConf.select(cfg, key) != value:
                OmegaConf.update(cfg, key, value)
                applied.append(f"{key}={value}")
        if cfg.reward.manager == "dapo" and not cfg.reward.manager_options:
            budget = cfg.rollout.max_response_tokens
            cfg.reward.manager_options = {"max_response_length": budget, "overlong_buffer_len": max(1, budget // 4)}
            applied.append(f"reward.manager_options={dict(cfg.reward.manager_options)}")
    return applied


def trains_critic(cfg) -> bool:
    """Whether the run trains a value model: its algorithm needs one (ppo) or critic.enable asks for it."""
    return ALGORITHM_PRESETS.get(cfg.trainer.algorithm).use_critic or bool(cfg.critic.enable)

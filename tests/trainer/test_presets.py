"""Algorithm presets fill only what the user left at its default, and a loss variant keeps its own defaults."""
import pytest

from rlfactory_megatron.actor.actor import policy_loss_options
from rlfactory_megatron.config import load_config
from rlfactory_megatron.trainer.presets import ALGORITHM_PRESETS, apply_preset


@pytest.mark.parametrize("algorithm", sorted(ALGORITHM_PRESETS))
def test_each_preset_sets_its_loss_and_implied_keys_on_defaults(algorithm):
    cfg = load_config(overrides=[f"trainer.algorithm={algorithm}"])
    preset, applied = apply_preset(cfg)
    assert cfg.actor.policy_loss == preset.policy_loss
    for key, value in preset.implied:
        assert f"{key}={value}" in applied
        node = cfg
        for part in key.split("."):
            node = node[part]
        assert node == value


@pytest.mark.parametrize("algorithm", sorted(ALGORITHM_PRESETS))
def test_a_key_the_user_set_is_kept(algorithm):
    cfg = load_config(overrides=[f"trainer.algorithm={algorithm}", "actor.policy_loss=dual-clip",
                                 "actor.clip_ratio_high=0.25", "reward.manager=batch"])
    apply_preset(cfg)
    assert cfg.actor.policy_loss == "dual-clip"
    assert cfg.actor.clip_ratio_high == 0.25 and cfg.reward.manager == "batch"


def test_loss_variants_keep_their_own_clip_defaults():
    assert policy_loss_options(load_config(overrides=["actor.policy_loss=gspo"]).actor) == {}  # 3e-4 / 4e-4 apply
    dual = load_config(overrides=["actor.policy_loss=dual-clip", "actor.clip_ratio_c=2.5"]).actor
    assert policy_loss_options(dual) == {"clip_ratio_c": 2.5}
    assert policy_loss_options(load_config(overrides=["actor.clip_ratio_c=2.5"]).actor) == {}  # only dual-clip has c
    dapo = load_config(overrides=["trainer.algorithm=dapo"])
    apply_preset(dapo)
    assert policy_loss_options(dapo.actor) == {"clip_high": 0.28}

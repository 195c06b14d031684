"""Algorithm presets fill, at load, only what the user set no value for, and a loss variant keeps its own defaults."""
import pytest

from rlfactory_megatron.actor.actor import policy_loss_options
from rlfactory_megatron.config import config_from_yaml, load_config, to_yaml
from rlfactory_megatron.trainer.presets import ALGORITHM_PRESETS


@pytest.mark.parametrize("algorithm", sorted(ALGORITHM_PRESETS))
def test_each_preset_sets_its_loss_and_implied_keys_on_defaults(algorithm):
    applied = []
    cfg = load_config(overrides=[f"trainer.algorithm={algorithm}"], preset_log=applied)
    preset = ALGORITHM_PRESETS.get(algorithm)
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
    assert cfg.actor.policy_loss == "dual-clip"
    assert cfg.actor.clip_ratio_high == 0.25 and cfg.reward.manager == "batch"


def test_a_key_set_to_its_schema_default_is_kept(tmp_path):
    """Set is set, whatever the value: gspo with actor.policy_loss=ppo (the schema's default) trains
    ppo, from the command line and from a config file alike."""
    assert load_config(overrides=["trainer.algorithm=gspo"]).actor.policy_loss == "gspo"
    assert load_config(overrides=["trainer.algorithm=gspo", "actor.policy_loss=ppo"]).actor.policy_loss == "ppo"
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  path: tiny://qwen3\ntrainer:\n  algorithm: gspo\n  task: calculator_arithmetic\n"
                    "actor:\n  policy_loss: ppo\n")
    assert load_config(path).actor.policy_loss == "ppo"
    assert load_config(path, ["actor.policy_loss=dual-clip"]).actor.policy_loss == "dual-clip"


def test_the_preset_is_applied_once_at_load():
    """The ranks' config (load_config's, as text) is used as it is: no second preset."""
    applied = []
    cfg = load_config(overrides=["trainer.algorithm=dapo", "actor.policy_loss=ppo"], preset_log=applied)
    assert "actor.policy_loss=clip-higher" not in applied
    assert config_from_yaml(to_yaml(cfg)) == cfg and cfg.actor.policy_loss == "ppo"


def test_loss_variants_keep_their_own_clip_defaults():
    assert policy_loss_options(load_config(overrides=["actor.policy_loss=gspo"]).actor) == {}  # 3e-4 / 4e-4 apply
    dual = load_config(overrides=["actor.policy_loss=dual-clip", "actor.clip_ratio_c=2.5"]).actor
    assert policy_loss_options(dual) == {"clip_ratio_c": 2.5}
    assert policy_loss_options(load_config(overrides=["actor.clip_ratio_c=2.5"]).actor) == {}  # only dual-clip has c
    assert policy_loss_options(load_config(overrides=["trainer.algorithm=dapo"]).actor) == {"clip_high": 0.28}
    # A value equal to the schema's old default is a setting too: gspo clipped at 0.2 as asked.
    assert policy_loss_options(load_config(overrides=["actor.policy_loss=gspo", "actor.clip_ratio_low=0.2"]).actor) == {
        "clip_low": 0.2}

"""Custom reward functions: loaded by path + name + kwargs; every misconfiguration fails at start-up, clearly."""
from types import SimpleNamespace

import pytest

from rlfactory_megatron.rewards import RewardConfigError, RewardFnSpec, load_reward_fn


def test_loads_function_with_kwargs(reward_fn_file):
    fn = load_reward_fn(RewardFnSpec(path=str(reward_fn_file), kwargs={"bonus": 0.25}))
    out = fn(data_source="d", solution_str="a", ground_truth="a", extra_info={})
    assert out == {"score": 1.25, "acc": 1.0}
    assert fn(data_source="d", solution_str="b", ground_truth="a", extra_info={})["score"] == 0.25


def test_loads_batched_function(reward_fn_file):
    fn = load_reward_fn(RewardFnSpec(path=str(reward_fn_file), name="batch_score", kwargs={"scale": 2.0}), batched=True)
    scores = fn(data_sources=["d", "d"], solution_strs=["ab", "abc"], ground_truths=[0, 0], extra_infos=[{}, {}])
    assert scores == [4.0, 6.0]


def test_builtin_scorers_when_no_path():
    fn = load_reward_fn(RewardFnSpec(kwargs={"method": "flexible"}))
    assert fn(data_source="openai/gsm8k", solution_str="it is 12", ground_truth="12", extra_info=None) == 1.0


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(RewardConfigError, match=r"reward\.custom_function_path: no file at .*nope\.py"):
        load_reward_fn(RewardFnSpec(path=str(missing)))


def test_missing_function_lists_what_is_there(reward_fn_file):
    expected = r"reward\.custom_function_name: .*no function 'score_it'.*'batch_score', 'compute_score'"
    with pytest.raises(RewardConfigError, match=expected):
        load_reward_fn(RewardFnSpec(path=str(reward_fn_file), name="score_it"))


def test_wrong_signature(tmp_path):
    path = tmp_path / "two_args.py"
    path.write_text("def compute_score(response, answer):\n    return 1.0\n")
    expected = r"custom_function_name: compute_score\(response, answer\).*cannot be called with \(data_source"
    with pytest.raises(RewardConfigError, match=expected):
        load_reward_fn(RewardFnSpec(path=str(path)))


def test_unknown_kwarg_is_a_signature_error(reward_fn_file):
    with pytest.raises(RewardConfigError, match=r"plus reward\.custom_function_kwargs \['bonsu'\]"):
        load_reward_fn(RewardFnSpec(path=str(reward_fn_file), kwargs={"bonsu": 1.0}))


def test_per_sample_function_is_not_a_batch_function(reward_fn_file):
    with pytest.raises(RewardConfigError, match=r"cannot be called with \(data_sources"):
        load_reward_fn(RewardFnSpec(path=str(reward_fn_file)), batched=True)


def test_import_error_names_the_file(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import not_a_module_anywhere\n")
    with pytest.raises(RewardConfigError, match=r"importing .*broken\.py failed: ModuleNotFoundError"):
        load_reward_fn(RewardFnSpec(path=str(path)))


def test_error_names_the_configured_key(tmp_path):
    spec = RewardFnSpec(path=str(tmp_path / "x.py"), config_prefix="stage2.reward")
    with pytest.raises(RewardConfigError, match=r"^stage2\.reward\.custom_function_path"):
        load_reward_fn(spec)


def test_fixed_builtin_scorer_ignores_data_source():
    fn = load_reward_fn(RewardFnSpec(scorer="math"))
    assert fn(data_source="my_dataset", solution_str="\\boxed{0.5}", ground_truth="\\frac12", extra_info={}) == 1.0
    with pytest.raises(RewardConfigError, match=r"reward\.scorer: unknown 'maths'.*gsm8k, math"):
        load_reward_fn(RewardFnSpec(scorer="maths"))


def test_spec_from_the_reward_config_section(reward_fn_file):
    section = SimpleNamespace(
        scorer="gsm8k",
        custom_function_path=str(reward_fn_file),
        custom_function_name=None,
        custom_function_kwargs={"bonus": 1},
    )
    spec = RewardFnSpec.from_config(section)
    assert (spec.path, spec.name, spec.kwargs) == (str(reward_fn_file), "compute_score", {"bonus": 1})
    assert spec.scorer == "gsm8k"
    assert load_reward_fn(spec)(data_source="d", solution_str="x", ground_truth="y", extra_info=None)["score"] == 1

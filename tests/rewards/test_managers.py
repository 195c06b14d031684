"""Reward managers: naive, batch, prime (processes + timeout) and dapo (overlong penalty), and their registry."""
import time

import pytest
import torch

from rlfactory_megatron.rewards import (
    REWARD_MANAGERS,
    RewardConfigError,
    RewardFnSpec,
    RewardSample,
    build_reward_manager,
)
from rlfactory_megatron.rewards.managers import overlong_penalty


def _samples(responses, truth="a", lengths=None):
    lengths = lengths or [3] * len(responses)
    return [RewardSample("d", r, truth, response_length=n) for r, n in zip(responses, lengths, strict=True)]


def test_registry_names():
    assert set(REWARD_MANAGERS) == {"naive", "batch", "prime", "dapo"}


def test_naive_builtin_scores_token_and_sequence_level():
    samples = [
        RewardSample("openai/gsm8k", "#### 7", "7", response_length=2),
        RewardSample("openai/gsm8k", "#### 8", "7", response_length=4),
        RewardSample("lighteval/MATH", "\\boxed{\\frac12}", "0.5", response_length=5),
    ]
    result = build_reward_manager("naive")(samples)
    assert result.scores == [1.0, 0.0, 1.0]
    tokens = result.token_level(width=5)
    assert tokens.shape == (3, 5)
    assert tokens[0].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]  # on the last valid response token
    assert tokens[2, 4] == 1.0 and torch.count_nonzero(tokens) == 2


def test_naive_extra_info_becomes_metrics_and_raising_costs_one_sample(reward_fn_file):
    manager = build_reward_manager("naive", RewardFnSpec(path=str(reward_fn_file)))
    result = manager(_samples(["a", "raise", "b", "a"]))
    assert result.scores == [1.0, 0.0, 0.0, 1.0]
    assert result.errors[1].startswith("RuntimeError: reward code failed") and result.errors.count(None) == 3
    metrics = result.metrics()
    assert metrics["reward/score/mean"] == 0.5
    assert metrics["reward/acc/mean"] == pytest.approx(2 / 3)  # the failed sample has no extras
    assert metrics["reward/errors"] == 1.0


def test_batch_makes_one_call(tmp_path):
    path = tmp_path / "batched.py"
    path.write_text(
        "CALLS = []\n"
        "def score_all(data_sources, solution_strs, ground_truths, extra_infos):\n"
        "    CALLS.append(len(solution_strs))\n"
        "    return [{'score': float(s == g), 'calls': len(CALLS)} for s, g in zip(solution_strs, ground_truths)]\n"
    )
    manager = build_reward_manager("batch", RewardFnSpec(path=str(path), name="score_all"))
    result = manager(_samples(["a", "b", "a"]))
    assert result.scores == [1.0, 0.0, 1.0]
    assert [e["calls"] for e in result.extras] == [1, 1, 1]


def test_batch_over_builtin_scorers_matches_naive():
    samples = [
        RewardSample("openai/gsm8k", "#### 1,000", "1000"),
        RewardSample("openai/gsm8k", "#### 999", "1000"),
        RewardSample("hiyouga/geometry3k", "<think>t</think>\\boxed{3}", "3"),
    ]
    assert build_reward_manager("batch")(samples).scores == build_reward_manager("naive")(samples).scores == [1, 0, 1]


def test_a_dict_without_score_is_that_samples_error(tmp_path):
    path = tmp_path / "no_score.py"
    path.write_text("def f(data_source, solution_str, ground_truth, extra_info):\n    return {'acc': 1.0}\n")
    result = build_reward_manager("naive", RewardFnSpec(path=str(path), name="f"))(_samples(["a"]))
    assert result.scores == [0.0] and "'score' key" in result.errors[0]


def test_batch_with_wrong_length_fails_every_sample(tmp_path):
    path = tmp_path / "short.py"
    path.write_text("def f(data_sources, solution_strs, ground_truths, extra_infos):\n    return [1.0]\n")
    result = build_reward_manager("batch", RewardFnSpec(path=str(path), name="f"))(_samples(["a", "a"]))
    assert result.scores == [0.0, 0.0]
    assert all("returned 1 scores for 2 samples" in e for e in result.errors)


@pytest.mark.parametrize(
    "length,expected",
    [
        (10, 0.0),  # well inside the budget
        (12, 0.0),  # the buffer's start: max_len - buffer
        (14, -0.25),  # the middle
        (16, -0.5),  # the end: the whole budget used
    ],
)
def test_dapo_overlong_penalty(length, expected):
    assert overlong_penalty(length, max_length=16, buffer=4, factor=0.5) == pytest.approx(expected)
    manager = build_reward_manager(
        "dapo", max_response_length=16, overlong_buffer_len=4, overlong_penalty_factor=0.5
    )
    result = manager([RewardSample("openai/gsm8k", "#### 1", "1", response_length=length)])
    assert result.scores == [pytest.approx(1.0 + expected)]
    assert result.extras[0]["overlong"] == float(expected < 0)


def test_dapo_rejects_a_buffer_larger_than_the_budget():
    with pytest.raises(RewardConfigError, match="overlong_buffer_len"):
        build_reward_manager("dapo", max_response_length=8, overlong_buffer_len=16)


def test_unknown_manager_and_options_are_config_errors():
    with pytest.raises(RewardConfigError, match=r"reward\.manager: unknown 'fast'.*naive, batch, prime, dapo"):
        build_reward_manager("fast")
    with pytest.raises(RewardConfigError, match=r"reward\.manager_options: .*timeout"):
        build_reward_manager("naive", timeout_s=3)
    with pytest.raises(RewardConfigError, match=r"max_response_length"):
        build_reward_manager("dapo", overlong_buffer_len=4)


@pytest.mark.serial  # a bound on wall time: run alone (scripts/test.sh)
def test_prime_times_out_and_survives_raising_and_crashing_samples(reward_fn_file):
    timeout = 1.0
    manager = build_reward_manager(
        "prime", RewardFnSpec(path=str(reward_fn_file), kwargs={"bonus": 0.5}), num_processes=2, timeout_s=timeout
    )
    try:
        assert manager(_samples(["a"])).scores == [1.5]  # starts the processes
        responses = ["a", "sleep", "b", "raise", "a", "exit", "a", "b"]
        started = time.monotonic()
        result = manager(_samples(responses))
        elapsed = time.monotonic() - started
        assert result.scores == [1.5, 0.0, 0.5, 0.0, 1.5, 0.0, 1.5, 0.5]
        assert "timed out after 1s" in result.errors[1]
        assert result.errors[3].startswith("RuntimeError: reward code failed")
        assert "died (exit code 3)" in result.errors[5]
        assert [e for i, e in enumerate(result.errors) if i not in (1, 3, 5)] == [None] * 5
        # The other process scores the rest while the stuck one is replaced: ~timeout in all.
        assert timeout <= elapsed < timeout + 1.5
    finally:
        manager.close()


@pytest.mark.parametrize("value", ["float('nan')", "float('inf')", "-float('inf')", "'0.5'", "{'score': float('nan')}",
                                   "None", "[1.0]"])
def test_a_non_finite_or_non_numeric_reward_is_that_samples_error(tmp_path, value):
    # One NaN reward makes every advantage of the batch and the update NaN: it must never leave the scorer.
    path = tmp_path / "odd.py"
    path.write_text("def f(data_source, solution_str, ground_truth, extra_info):\n"
                    f"    return {value} if solution_str == 'odd' else 1.0\n"
                    "def g(data_sources, solution_strs, ground_truths, extra_infos):\n"
                    "    return [f(d, s, t, e) for d, s, t, e in zip(data_sources, solution_strs, ground_truths, extra_infos)]\n")
    for manager, name in (("naive", "f"), ("batch", "g")):
        result = build_reward_manager(manager, RewardFnSpec(path=str(path), name=name))(_samples(["a", "odd", "b"]))
        assert result.scores == [1.0, 0.0, 1.0], manager
        assert result.errors[0] is None and result.errors[2] is None and result.errors[1], manager
        assert all(isinstance(s, float) for s in result.scores)

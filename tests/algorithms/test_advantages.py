"""Advantage estimators against plain-Python references on small tensors."""
import math

import pytest
import torch

from rlfactory_megatron.algorithms import ADVANTAGE_ESTIMATORS, compute_advantages


def assert_close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


def py_whiten(rows, masks):
    flat = [x for row, m in zip(rows, masks) for x, k in zip(row, m) if k]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    return [[(x - mean) / math.sqrt(var + 1e-8) if k else 0.0 for x, k in zip(row, m)] for row, m in zip(rows, masks)]


def py_gae(rewards, values, masks, gamma, lam):
    advs, rets = [], []
    for r, v, m in zip(rewards, values, masks):
        adv, next_v, last = [0.0] * len(r), 0.0, 0.0
        for t in reversed([i for i, k in enumerate(m) if k]):
            last = r[t] + gamma * next_v - v[t] + gamma * lam * last
            adv[t], next_v = last, v[t]
        advs.append(adv)
        rets.append([a + x if k else 0.0 for a, x, k in zip(adv, v, m)])
    return advs, rets


REWARDS = [[0.0, 0.3, 0.0, 0.0, 1.0], [0.0, 0.0, 0.5, 0.0, 0.0], [0.2, 0.0, 0.0, -1.0, 0.0]]
VALUES = [[0.5, 0.2, 0.9, 0.1, 0.4], [0.3, -0.2, 0.6, 0.0, 0.0], [0.1, 0.7, 0.2, 0.3, 0.0]]
# Row 0 has a masked "tool observation" span in the middle; rows 1, 2 end with padding.
MASKS = [[1, 1, 0, 0, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_gae_hand_numbers_gamma_lambda_one():
    # One sequence, gamma = lambda = 1: returns are reward-to-go, advantages = returns - values.
    out = compute_advantages("gae", t([[0.0, 0.0, 1.0]]), t([[1, 1, 1]]), values=t([[0.5, 0.2, 0.1]]))
    assert_close(out.returns, [[1.0, 1.0, 1.0]])
    raw = [0.5, 0.8, 0.9]  # whitened: mean 0.7333, unbiased std 0.2082
    mean, std = sum(raw) / 3, math.sqrt(sum((x - sum(raw) / 3) ** 2 for x in raw) / 2)
    assert_close(out.advantages[0], [(x - mean) / std for x in raw], 1e-6)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (0.5, 0.0)])
def test_gae_matches_loop_and_skips_masked_span(gamma, lam):
    ref_adv, ref_ret = py_gae(REWARDS, VALUES, MASKS, gamma, lam)
    out = compute_advantages("gae", t(REWARDS), t(MASKS), values=t(VALUES), gamma=gamma, lam=lam)
    assert_close(out.returns, ref_ret, 1e-12)
    assert_close(out.advantages, py_whiten(ref_adv, MASKS), 1e-9)


def test_gae_ignores_garbage_on_masked_tokens():
    rewards, values = t(REWARDS), t(VALUES)
    masked = t(MASKS) == 0
    base = compute_advantages("gae", rewards, t(MASKS), values=values, gamma=0.9, lam=0.9)
    noisy = compute_advantages(
        "gae", rewards.masked_fill(masked, float("nan")), t(MASKS), values=values.masked_fill(masked, 1e30), gamma=0.9, lam=0.9
    )
    assert torch.equal(base.advantages, noisy.advantages) and torch.equal(base.returns, noisy.returns)


GROUP_REWARDS = [[0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [5.0, 0.0]]
GROUP_MASK = [[1, 1], [1, 1], [1, 1], [1, 1], [1, 1], [1, 0]]
# scores (sum of valid rewards): [1, 0, 1, 2, 3, 5]; groups {0, 1}, {2, 3, 4}, {5} (given out of order ids)
GROUP_INDEX = torch.tensor([7, 7, 3, 3, 3, 11])


def test_grpo_hand_numbers():
    out = compute_advantages("grpo", t(GROUP_REWARDS), t(GROUP_MASK), group_index=GROUP_INDEX)
    s2 = math.sqrt(0.5)  # unbiased std of {1, 0}
    expected = [0.5 / (s2 + 1e-6), -0.5 / (s2 + 1e-6), -1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6), 5 / (1 + 1e-6)]
    assert_close(out.advantages[:, 0], expected, 1e-9)
    assert out.advantages[5, 1] == 0.0 and torch.equal(out.advantages, out.returns)
    assert torch.equal(out.advantages[:5, 0], out.advantages[:5, 1])


def test_drgrpo_hand_numbers():
    out = compute_advantages("drgrpo", t(GROUP_REWARDS), t(GROUP_MASK), group_index=GROUP_INDEX)
    assert_close(out.advantages[:, 0], [0.5, -0.5, -1.0, 0.0, 1.0, 5.0])


def test_rloo_hand_numbers():
    out = compute_advantages("rloo", t(GROUP_REWARDS), t(GROUP_MASK), group_index=GROUP_INDEX)
    # 1 - 0, 0 - 1, 1 - (2+3)/2, 2 - (1+3)/2, 3 - (1+2)/2, singleton keeps its score
    assert_close(out.advantages[:, 0], [1.0, -1.0, -1.5, 0.0, 1.5, 5.0])


def test_reinforce_plus_plus_matches_loop():
    gamma = 0.8
    returns = []
    for r, m in zip(REWARDS, MASKS):
        row, running = [0.0] * len(r), 0.0
        for i in reversed([i for i, k in enumerate(m) if k]):
            running = r[i] + gamma * running
            row[i] = running
        returns.append(row)
    out = compute_advantages("reinforce++", t(REWARDS), t(MASKS), gamma=gamma)
    assert_close(out.returns, returns, 1e-12)
    assert_close(out.advantages, py_whiten(returns, MASKS), 1e-9)


def test_reinforce_plus_plus_baseline_matches_loop():
    out = compute_advantages("reinforce++-baseline", t(GROUP_REWARDS), t(GROUP_MASK), group_index=GROUP_INDEX)
    centered = [0.5, -0.5, -1.0, 0.0, 1.0, 5.0]
    rows = [[c if k else 0.0 for k in m] for c, m in zip(centered, GROUP_MASK)]
    assert_close(out.advantages, py_whiten(rows, GROUP_MASK), 1e-9)


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "reinforce++-baseline"])
def test_group_estimators_name_missing_input(name):
    with pytest.raises(ValueError, match="group_index"):
        compute_advantages(name, t(GROUP_REWARDS), t(GROUP_MASK))


def test_unknown_estimator_lists_choices():
    with pytest.raises(KeyError, match="gae"):
        ADVANTAGE_ESTIMATORS.get("ppo2")


GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce++-baseline")


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_a_group_of_equal_rewards_gets_exactly_zero_advantage(name):
    # float32 means of e.g. 8 x 0.9 are one ulp off; divided by a ~6e-8 std that was +-0.056.
    from rlfactory_megatron.algorithms.advantages import compute_advantages

    gen = torch.Generator().manual_seed(0)
    values = [0.9, 0.7, 0.1, 1 / 3, 0.3, -0.3, 12345.678, 1e-7] + (torch.rand(24, generator=gen) * 4 - 2).tolist()
    for value in values:
        for size in range(2, 17):
            rewards = torch.zeros(2 * size, 6)
            rewards[:size, -1] = value
            rewards[size:, -1] = torch.rand(size, generator=gen)
            mask = torch.ones(2 * size, 6)
            groups = torch.arange(2 * size) // size
            adv = compute_advantages(name, rewards, mask, group_index=groups).advantages
            assert adv.dtype == torch.float32
            assert torch.count_nonzero(adv[:size]) == 0, (value, size)
            assert torch.count_nonzero(adv[size:]) > 0

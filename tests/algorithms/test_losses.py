"""Policy/value losses, KL penalties, entropy bonus and aggregation modes against hand-computed values."""
import math

import pytest
import torch

from rlfactory_megatron.algorithms import (
    aggregate_loss,
    clipped_value_loss,
    compute_policy_loss,
    entropy_bonus,
    kl_penalty,
)

LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0], [7.0, 7.0, 7.0, 7.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # last row: padding only


def assert_close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", (1 + 2 + 3 + 10) / 4),
        ("seq-mean-token-sum", (6 + 10) / 2),
        ("seq-mean-token-mean", (2 + 10) / 2),
        ("seq-mean-token-sum-norm", (6 + 10) / 2 / 4),
    ],
)
def test_aggregation_modes(mode, expected):
    assert aggregate_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_aggregation_global_counts_and_norm_length():
    assert aggregate_loss(LOSS, MASK, "token-mean", num_units=8).item() == pytest.approx(16 / 8)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum", num_units=4).item() == pytest.approx(16 / 4)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_length=100).item() == pytest.approx(8 / 100)


def py_ppo(logp, old, adv, low, high, c=None):
    r = math.exp(logp - old)
    loss = max(-adv * r, -adv * min(max(r, 1 - low), 1 + high))
    if c is not None and adv < 0:
        loss = min(loss, -adv * c)
    return loss, (-adv * min(max(r, 1 - low), 1 + high)) > -adv * r


LOGP = [[-1.0, -0.5, -2.0], [-0.1, -3.0, -1.2]]
OLD = [[-1.2, -0.5, -0.8], [-0.4, -1.0, -1.2]]
ADV = [[1.0, -0.5, 2.0], [-1.5, -2.0, 0.7]]
PG_MASK = [[1, 1, 1], [1, 1, 0]]


@pytest.mark.parametrize(
    "name,options,low,high,c",
    [
        ("ppo", {"clip_low": 0.2}, 0.2, 0.2, None),
        ("clip-higher", {}, 0.2, 0.28, None),
        ("dual-clip", {"clip_low": 0.1}, 0.1, 0.1, 3.0),
        ("ppo", {"clip_low": 0.2, "clip_high": 0.3, "clip_ratio_c": 1.5}, 0.2, 0.3, 1.5),
    ],
)
def test_ppo_family_matches_scalar_formula(name, options, low, high, c):
    tokens = [(i, j) for i in range(2) for j in range(3) if PG_MASK[i][j]]
    per_tok = {ij: py_ppo(LOGP[ij[0]][ij[1]], OLD[ij[0]][ij[1]], ADV[ij[0]][ij[1]], low, high, c) for ij in tokens}
    out = compute_policy_loss(name, torch.tensor(LOGP), torch.tensor(OLD), torch.tensor(ADV), torch.tensor(PG_MASK), **options)
    assert out.loss.item() == pytest.approx(sum(v[0] for v in per_tok.values()) / len(tokens), abs=1e-6)
    assert out.metrics["clip_frac"].item() == pytest.approx(sum(v[1] for v in per_tok.values()) / len(tokens))
    kl = sum(OLD[i][j] - LOGP[i][j] for i, j in tokens) / len(tokens)
    assert out.metrics["approx_kl"].item() == pytest.approx(kl, abs=1e-6)


def test_dual_clip_hand_number():
    # ratio e^2 = 7.39 with A = -1: PPO loss 7.39, dual-clip caps it at c * |A| = 3.
    out = compute_policy_loss("dual-clip", torch.tensor([[0.0]]), torch.tensor([[-2.0]]), torch.tensor([[-1.0]]), torch.tensor([[1]]))
    assert out.loss.item() == pytest.approx(3.0)
    assert out.metrics["dual_clip_frac"].item() == 1.0


def test_gspo_value_and_gradient():
    logp = torch.tensor(LOGP, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]])  # GSPO: one advantage per sequence
    low, high = 0.05, 0.1
    out = compute_policy_loss("gspo", logp, torch.tensor(OLD), adv, torch.tensor(PG_MASK), clip_low=low, clip_high=high)
    out.loss.backward()
    expected, grads = 0.0, []
    for i, n in ((0, 3), (1, 2)):
        s = math.exp(sum(LOGP[i][j] - OLD[i][j] for j in range(n)) / n)
        a = adv[i, 0].item()
        clipped = min(max(s, 1 - low), 1 + high)
        expected += max(-a * s, -a * clipped) / 2  # seq-mean-token-mean over 2 sequences
        # Gradient flows only through the unclipped branch: d/dlogp_j = -a * s / n / 2 per token.
        active = -a * s >= -a * clipped
        grads.append([(-a * s / n / 2 if active else 0.0) if j < n else 0.0 for j in range(3)])
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    assert_close(logp.grad, grads, 1e-6)


def test_clipped_value_loss_hand_numbers():
    values = torch.tensor([[1.0, 0.0, 2.0]])
    old = torch.tensor([[0.5, 0.1, 2.0]])
    ret = torch.tensor([[2.0, 0.0, 9.0]])
    mask = torch.tensor([[1, 1, 0]])
    out = clipped_value_loss(values, old, ret, mask, clip_range=0.2)
    # token 0: unclipped (1-2)^2 = 1, clipped v = 0.7 -> 1.69; token 1: 0 vs (0.0-0)^2 -> 0
    assert out.loss.item() == pytest.approx(0.5 * (1.69 + 0.0) / 2)
    assert out.metrics["vf_clip_frac"].item() == pytest.approx(0.5)


def test_kl_estimators_hand_numbers():
    logp, ref, mask = torch.tensor([[-1.0, -2.0, 5.0]]), torch.tensor([[-1.5, -1.0, 0.0]]), torch.tensor([[1, 1, 0]])
    assert_close(kl_penalty("k1", logp, ref, mask), [[0.5, -1.0, 0.0]])
    assert_close(kl_penalty("k2", logp, ref, mask), [[0.125, 0.5, 0.0]])
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1, 0.0]
    assert_close(kl_penalty("k3", logp, ref, mask)[0], k3, 1e-6)
    far = kl_penalty("low-var-kl", torch.tensor([[-30.0]]), torch.tensor([[0.0]]), torch.tensor([[1]]))
    assert far.item() == 10.0  # clamped


def test_entropy_bonus():
    ent = torch.tensor([[1.0, 3.0], [2.0, 100.0]])
    assert entropy_bonus(ent, torch.tensor([[1, 1], [1, 0]]), 0.01).item() == pytest.approx(-0.01 * 2.0)

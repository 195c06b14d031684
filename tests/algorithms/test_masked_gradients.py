"""Masked tokens contribute exactly nothing: zero gradient, and garbage on them changes nothing."""
import pytest
import torch

from rlfactory_megatron.algorithms import (
    LOSS_AGGREGATIONS,
    KL_PENALTIES,
    POLICY_LOSSES,
    aggregate_loss,
    clipped_value_loss,
    compute_policy_loss,
    entropy_bonus,
    kl_penalty,
)

torch.manual_seed(0)
B, L = 4, 7
MASK = torch.rand(B, L) > 0.4
MASK[:, 0] = True
GARBAGE = torch.where(torch.rand(B, L) > 0.5, float("inf"), float("nan"))


def inputs(noisy: bool):
    gen = torch.Generator().manual_seed(1)
    logp = -torch.rand(B, L, generator=gen) * 3
    other = -torch.rand(B, L, generator=gen) * 3
    adv = torch.randn(B, L, generator=gen)
    if noisy:
        logp, other, adv = (torch.where(MASK, x, GARBAGE) for x in (logp, other, adv))
    return logp.requires_grad_(), other, adv


def check(make_loss):
    results = []
    for noisy in (False, True):
        logp, other, adv = inputs(noisy)
        loss = make_loss(logp, other, adv)
        loss.backward()
        assert torch.isfinite(loss)
        assert torch.all(logp.grad[~MASK] == 0)
        results.append((loss.detach(), logp.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert results[0][1][MASK].abs().sum() > 0


@pytest.mark.parametrize("name", list(POLICY_LOSSES))
@pytest.mark.parametrize("agg_mode", list(LOSS_AGGREGATIONS))
def test_policy_losses(name, agg_mode):
    check(lambda logp, old, adv: compute_policy_loss(name, logp, old, adv, MASK, agg_mode=agg_mode, clip_low=0.5).loss)


@pytest.mark.parametrize("name", list(KL_PENALTIES))
def test_kl_penalties(name):
    check(lambda logp, ref, _: aggregate_loss(kl_penalty(name, logp, ref, MASK), MASK))


def test_value_loss():
    check(lambda v, old, ret: clipped_value_loss(v, old, ret, MASK, clip_range=0.1).loss)


def test_entropy_bonus():
    check(lambda ent, _, __: entropy_bonus(ent, MASK, 0.01, agg_mode="seq-mean-token-mean"))

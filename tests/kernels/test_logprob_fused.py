"""Fused log-prob/entropy (PyTorch path, tp=1) == naive full-logits computation, values and gradients."""
import pytest
import torch

from logprob_cases import assert_matches_naive, make_inputs, run
from rlfactory_megatron.kernels import fused_logprob_entropy, naive_logprob_entropy


@pytest.mark.parametrize(
    "T,V,H,chunk_size",
    [(1, 7, 4, 1), (37, 100, 16, 8), (64, 257, 32, 64), (100, 1000, 24, 33), (129, 512, 16, 1000)],
)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_matches_naive(T, V, H, chunk_size, temperature):
    assert_matches_naive(T, V, H, chunk_size=chunk_size, temperature=temperature)


@pytest.mark.parametrize("T,V,vocab_size,chunk_size", [(37, 128, 100, 8), (16, 64, 1, 5), (20, 512, 500, 32)])
def test_padded_vocab_rows_get_no_probability(T, V, vocab_size, chunk_size):
    assert_matches_naive(T, V, 16, chunk_size=chunk_size, vocab_size=vocab_size)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_qwen_sized_vocab_matches_exact(temperature):
    # H >= 16: with fewer output columns, MKL gemm sums the vocab axis term by term (~1e-5 error) on any path.
    assert_matches_naive(19, 152064, 32, chunk_size=7, temperature=temperature, reference_dtype=torch.float64)


def test_default_chunk_and_leading_dims():
    hidden, weight, targets, *_ = make_inputs(24, 50, 8)
    logp, entropy = fused_logprob_entropy(hidden.view(4, 6, 8), weight, targets.view(4, 6))
    ref_logp, ref_entropy = naive_logprob_entropy(hidden, weight, targets)
    assert logp.shape == (4, 6)
    torch.testing.assert_close(logp.flatten(), ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.flatten(), ref_entropy, atol=1e-5, rtol=1e-5)


def test_frozen_weight_and_logp_only():
    # Reference-model case: weight frozen, only log-probs used (entropy grad arrives as zeros).
    hidden, weight, targets, grad_logp, _ = make_inputs(30, 40, 8)
    h = hidden.clone().requires_grad_()
    fused_logp, _ = fused_logprob_entropy(h, weight, targets, chunk_size=7)
    (fused_logp * grad_logp).sum().backward()
    h_ref = hidden.clone().requires_grad_()
    (naive_logprob_entropy(h_ref, weight, targets)[0] * grad_logp).sum().backward()
    torch.testing.assert_close(h.grad, h_ref.grad, atol=1e-5, rtol=1e-5)


def test_extreme_logits_stay_finite():
    hidden, weight, targets, *_ = make_inputs(16, 64, 8)
    logp, entropy = fused_logprob_entropy(hidden * 200, weight, targets, chunk_size=5)
    ref_logp, ref_entropy = naive_logprob_entropy(hidden * 200, weight, targets)
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()
    torch.testing.assert_close(logp, ref_logp, atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs,match",
    [({"temperature": 0.0}, "temperature"), ({"chunk_size": 0}, "chunk_size"), ({"impl": "cuda"}, "impl"),
     ({"vocab_size": 0}, "vocab_size")],
)
def test_bad_arguments_are_named(kwargs, match):
    hidden, weight, targets, *_ = make_inputs(4, 10, 8)
    with pytest.raises(ValueError, match=match):
        fused_logprob_entropy(hidden, weight, targets, **kwargs)


def test_bf16_inputs_give_fp32_outputs_and_bf16_grads():
    hidden, weight, targets, grad_logp, grad_entropy = make_inputs(40, 300, 32)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    got = run(fused_logprob_entropy, hidden, weight, targets, grad_logp, grad_entropy, chunk_size=16)
    ref = run(naive_logprob_entropy, hidden, weight, targets, grad_logp, grad_entropy)
    assert got[0].dtype == torch.float32 and got[2].dtype == got[3].dtype == torch.bfloat16
    # bf16 logits carry ~1e-2 error either way; this checks the dtype plumbing, not precision.
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=5e-2)

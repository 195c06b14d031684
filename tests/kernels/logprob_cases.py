"""Shared inputs and comparison for the fused log-prob tests (tp=1, tp=2, Triton)."""
import torch

from rlfactory_megatron.kernels import fused_logprob_entropy, naive_logprob_entropy


def make_inputs(T: int, V: int, H: int, seed: int = 0):
    """hidden [T, H], full weight [V, H] scaled like an LM head (logits of order 1-3), targets, output grads."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * (2.0 / H**0.5)
    targets = torch.randint(0, V, (T,), generator=gen)
    grad_logp, grad_entropy = torch.randn(T, generator=gen), torch.randn(T, generator=gen)
    return hidden, weight, targets, grad_logp, grad_entropy


def run(fn, hidden, weight, targets, grad_logp, grad_entropy, **kw):
    """(logp, entropy, d/dhidden, d/dweight) of sum(logp * g1 + entropy * g2)."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, entropy = fn(h, w, targets, **kw)
    (logp * grad_logp + entropy * grad_entropy).sum().backward()
    return logp.detach(), entropy.detach(), h.grad, w.grad


def assert_matches_naive(
    T, V, H, *, chunk_size, temperature=1.0, impl="torch", tp_group=None, rank=0, world=1, reference_dtype=torch.float32,
    vocab_size=None,
):
    """Fused on this rank's vocab shard == naive on the full vocab (rows of the weight-grad: this shard).

    reference_dtype=float64 compares against exact math instead: at V ~ 150k the fp32 naive path
    is itself off by up to ~6e-5, so only the exact value can be held to 1e-5.
    vocab_size < V: the weight's last V - vocab_size rows are padding (random, so they would
    show if not masked); the reference is naive on the real rows, with zero grad for the padding.
    """
    hidden, weight, targets, g1, g2 = make_inputs(T, V, H, seed=T * 1000 + V)
    real = V if vocab_size is None else vocab_size
    targets = targets % real
    shard = V // world
    rows = slice(rank * shard, (rank + 1) * shard)
    ref_inputs = (x.to(reference_dtype) if x.is_floating_point() else x for x in (hidden, weight[:real], targets, g1, g2))
    ref = [x.float() for x in run(naive_logprob_entropy, *ref_inputs, temperature=temperature)]
    ref_grad_weight = torch.zeros(V, H)
    ref_grad_weight[:real] = ref[3]
    got = run(
        fused_logprob_entropy, hidden, weight[rows], targets, g1, g2,
        tp_group=tp_group, temperature=temperature, chunk_size=chunk_size, impl=impl, vocab_size=vocab_size,
    )
    for name, a, b in zip(("logp", "entropy", "grad_hidden", "grad_weight"), got, (*ref[:3], ref_grad_weight[rows])):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name} T={T} V={V} chunk={chunk_size}: {m}")

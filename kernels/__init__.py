"""Fused vocab-parallel log-prob/entropy and other hot paths (Triton on GPU, PyTorch reference)."""
from rlfactory_megatron.kernels.logprob import fused_logprob_entropy, naive_logprob_entropy

__all__ = ["fused_logprob_entropy", "naive_logprob_entropy"]

"""Log-prob and entropy of target tokens from hidden states and a vocab-parallel output layer."""
from rlfactory_megatron.kernels.logprob.fused import fused_logprob_entropy
from rlfactory_megatron.kernels.logprob.naive import naive_logprob_entropy

__all__ = ["fused_logprob_entropy", "naive_logprob_entropy"]

"""Fused vocab-parallel log-prob/entropy and other hot paths (Triton on GPU, PyTorch reference)."""

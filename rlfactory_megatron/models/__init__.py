"""Megatron-Core models built from HF configs, HF <-> Megatron conversion and checkpoints."""

"""rlfactory-megatron: Megatron-Core RL backend for training tool-using LLM agents."""

__version__ = "0.1.0"

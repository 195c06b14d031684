"""Rollout engines (vLLM) and streamed, bucketed weight sync from the Megatron actor."""

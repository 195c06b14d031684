"""Tiny random-weight HF checkpoints built locally (no hub): for tests, benchmarks and the embedded default."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# head_dim >= 32: vLLM's CPU attention needs it.
TINY_DEFAULTS: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=512,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

# The MoE family's shape: 8 experts, top-2 (hidden % 32 == 0 keeps it servable by vLLM's CPU MoE kernel).
TINY_MOE_DEFAULTS: dict[str, Any] = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                         norm_topk_prob=True)

_CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
                   "qwen3_moe": "Qwen3MoeConfig"}


def make_tiny_hf_model(
    model_type: str, out_dir: str | Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> Path:
    """Save a random-weight `model_type` checkpoint (safetensors + config.json) to `out_dir`."""
    import transformers

    if model_type not in _CONFIG_CLASSES:
        raise ValueError(f"model_type must be one of {sorted(_CONFIG_CLASSES)}, not '{model_type}'")
    kwargs = {**TINY_DEFAULTS, **(TINY_MOE_DEFAULTS if model_type == "qwen3_moe" else {}), **overrides}
    if model_type == "llama" and "rope_scaling" not in kwargs:
        kwargs["rope_scaling"] = {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 500000.0,
        }
        kwargs["rope_theta"] = 500000.0
    config = getattr(transformers, _CONFIG_CLASSES[model_type])(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        # Random norms (HF inits them to 1) so a wrong norm mapping cannot hide.
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            elif name.endswith("mlp.gate.weight"):
                # A decisive router (HF's init scores every expert alike), so that rounding
                # differences between implementations cannot flip a token's top-k choice.
                param.normal_(0.0, 0.1)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir

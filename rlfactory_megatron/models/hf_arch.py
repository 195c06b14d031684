"""Hugging Face `config.json` -> what megatron needs to build the same decoder (Llama 3, Qwen2/2.5, Qwen3, Qwen3-MoE)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ArchFeatures:
    """What distinguishes one supported decoder family from another."""

    qkv_bias: bool
    qk_norm: bool
    moe: bool = False  # every layer's MLP is a mixture of SwiGLU experts behind a softmax top-k router


# One entry per supported HF `model_type`; everything else about the layer is shared
# (pre-norm RMSNorm, GQA attention with RoPE, SwiGLU MLP or experts, no other biases).
SUPPORTED_ARCHITECTURES: dict[str, ArchFeatures] = {
    "llama": ArchFeatures(qkv_bias=False, qk_norm=False),
    "qwen2": ArchFeatures(qkv_bias=True, qk_norm=False),
    "qwen3": ArchFeatures(qkv_bias=False, qk_norm=True),
    "qwen3_moe": ArchFeatures(qkv_bias=False, qk_norm=True, moe=True),
}


@dataclass(frozen=True)
class MoEShape:
    """The sparse MLP of a mixture-of-experts decoder: every layer sparse, no shared expert."""

    num_experts: int
    top_k: int  # experts each token is routed to
    expert_ffn_hidden_size: int  # one expert's SwiGLU intermediate size (HF moe_intermediate_size)
    norm_topk_prob: bool  # the top-k routing probabilities are renormalized to sum to 1


@dataclass(frozen=True)
class ModelArch:
    """A decoder's shape, read from a HF config. All sizes are the unpadded HF ones."""

    model_type: str
    features: ArchFeatures
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    torch_dtype: str
    moe: MoEShape | None = None  # None: a dense model
    hf_config: dict[str, Any] = field(repr=False, compare=False, hash=False, default_factory=dict)

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def padded_vocab_size(self, tp: int, divisible_by: int = 128) -> int:
        """Megatron's vocab-parallel layers need the vocab split evenly across TP ranks."""
        multiple = divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def parameter_count(self, tp: int = 1, pp: int = 1, stage: int = 0, value_head: bool = False, ep: int = 1,
                        etp: int | None = None) -> int:
        """Parameters of the megatron model on one rank of pipeline stage `stage` (at tp=pp=1:
        the whole model, e.g. 7,615,616,512 for Qwen2-7B). The first stage holds the embedding,
        the last the final norm and the LM head (a tied head is a copy of its own there when
        pp > 1) or, for a critic, the [hidden -> 1] value head; TP splits every projection and
        the vocab, norms are replicated. A MoE layer's experts are split over `ep` ranks (and
        each over `etp`, by default tp as megatron's), its router replicated."""
        h, hd = self.hidden_size, self.head_dim
        qkv = (self.num_heads + 2 * self.num_kv_heads) * hd
        if self.moe is None:
            mlp = 3 * self.ffn_hidden_size * h // tp  # SwiGLU: gate, up, down
        else:
            mlp = self.moe.num_experts * h  # router; the experts are counted below
        layer = (2 * h  # the attention's and the MLP's RMSNorm
                 + (qkv * h + (qkv if self.features.qkv_bias else 0)) // tp
                 + (2 * hd if self.features.qk_norm else 0)  # q/k RMSNorm over head_dim, replicated
                 + self.num_heads * hd * h // tp  # output projection
                 + mlp)
        count = self.num_layers // pp * layer + self.expert_parameter_count(tp if etp is None else etp, pp, ep)
        vocab = self.padded_vocab_size(tp) // tp * h
        if stage == 0:
            count += vocab
        if stage == pp - 1:
            count += h  # final norm
            if value_head:
                count += h
            elif not self.tie_word_embeddings or pp > 1:
                count += vocab
        return count

    def expert_parameter_count(self, etp: int = 1, pp: int = 1, ep: int = 1) -> int:
        """Expert parameters on one rank (part of parameter_count): its experts / ep of each MoE
        layer of its stage, each split over `etp` expert-TP ranks; 0 for a dense model."""
        if self.moe is None:
            return 0
        return self.num_layers // pp * (self.moe.num_experts // ep * 3 * self.moe.expert_ffn_hidden_size
                                         * self.hidden_size // etp)

    def kv_cache_bytes_per_token(self, element_size: int, tp: int = 1) -> int:
        """Keys and values of one token in every layer, on one of `tp` devices (KV heads are
        replicated when tp exceeds them)."""
        return 2 * self.num_layers * max(1, self.num_kv_heads // tp) * self.head_dim * element_size


class UnsupportedCheckpointError(ValueError):
    """The HF checkpoint is of an architecture or shape this project cannot convert."""


def _rope_params(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers 5 moved theta and scaling into `rope_parameters`; older configs keep them top-level.
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"} or None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            scaling = None
        elif kind != "llama3":
            raise UnsupportedCheckpointError(
                f"rope scaling type '{kind}' is not supported (supported: default, llama3)"
            )
    return theta, scaling


def arch_from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> ModelArch:
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedCheckpointError(
            f"{source}: model_type '{model_type}' is not supported; supported: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if key not in cfg:
            raise UnsupportedCheckpointError(f"{source}: required key '{key}' is missing")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedCheckpointError(f"{source}: hidden_act '{cfg['hidden_act']}' is not supported (silu)")
    num_heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads)
    theta, scaling = _rope_params(cfg)
    features = SUPPORTED_ARCHITECTURES[model_type]
    if model_type == "llama" and cfg.get("attention_bias", False):
        raise UnsupportedCheckpointError(f"{source}: llama with attention_bias=true is not supported")
    moe = _moe_shape(cfg, source) if features.moe else None
    return ModelArch(
        model_type=model_type,
        features=features,
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=int(cfg["hidden_size"]),
        ffn_hidden_size=int(cfg["intermediate_size"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        moe=moe,
        hf_config=dict(cfg),
    )


def _moe_shape(cfg: dict[str, Any], source: str) -> MoEShape:
    # Qwen3-MoE checkpoints name the expert count `num_experts`; transformers 5 saves `num_local_experts`.
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    for key, value in (("num_experts", num_experts), ("num_experts_per_tok", cfg.get("num_experts_per_tok")),
                       ("moe_intermediate_size", cfg.get("moe_intermediate_size"))):
        if value is None:
            raise UnsupportedCheckpointError(f"{source}: required key '{key}' is missing")
    # Megatron builds one layer spec for the whole decoder: dense layers between sparse ones are not built.
    if int(cfg.get("decoder_sparse_step", 1)) != 1 or cfg.get("mlp_only_layers"):
        raise UnsupportedCheckpointError(f"{source}: dense MLP layers in a MoE model (decoder_sparse_step="
                                         f"{cfg.get('decoder_sparse_step', 1)}, mlp_only_layers="
                                         f"{cfg.get('mlp_only_layers')}) are not supported; every layer must be sparse")
    return MoEShape(num_experts=int(num_experts), top_k=int(cfg["num_experts_per_tok"]),
                    expert_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))


def load_arch(hf_dir: str | Path) -> ModelArch:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise UnsupportedCheckpointError(f"{path}: not found; --hf-dir must be a Hugging Face model folder")
    return arch_from_hf_config(json.loads(path.read_text()), source=str(path))


def rope_inv_freq(arch: ModelArch):
    """Inverse RoPE frequencies exactly as the HF model computes them (incl. Llama 3 scaling)."""
    import torch

    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if arch.rope_scaling is None:
        return inv_freq
    s = arch.rope_scaling
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    original = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by `factor`, short ones kept, the band between blended smoothly.
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, blended, scaled)

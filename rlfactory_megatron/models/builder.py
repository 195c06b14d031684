"""Build megatron-core GPTModel chunks for this rank from a ModelArch (policy LM or critic value head)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlfactory_megatron.models.hf_arch import ModelArch, rope_inv_freq
from rlfactory_megatron.runtime.cpu_compat import cuda_available

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class BuildOptions:
    params_dtype: str = "float32"
    value_head: bool = False  # critic: a [hidden -> 1] head instead of the LM head
    layer_spec: str = "auto"  # "auto" | "local" | "transformer_engine"
    recompute_activations: bool = False
    sequence_parallel: bool = False
    padded_vocab_size: int | None = None  # keep a checkpoint's padding when loading it at another TP


def _transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_layer_spec(choice: str) -> str:
    """Local spec on CPU; Transformer-Engine spec on GPU when TE is installed."""
    if choice == "auto":
        return "transformer_engine" if cuda_available() and _transformer_engine_available() else "local"
    if choice == "transformer_engine" and not _transformer_engine_available():
        raise ValueError("model.layer_spec=transformer_engine but transformer_engine is not installed "
                         "(install with ./install.sh --gpu, or use model.layer_spec=local)")
    if choice not in ("local", "transformer_engine"):
        raise ValueError(f"model.layer_spec must be auto, local or transformer_engine, not '{choice}'")
    return choice


def transformer_config(arch: ModelArch, options: BuildOptions):
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    dtype = _DTYPES[options.params_dtype]
    on_gpu = cuda_available()
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.features.qkv_bias,
        qk_layernorm=arch.features.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        sequence_parallel=options.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        # Fusions are CUDA kernels; the unfused paths compute the same function.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        # gloo cannot batch isend/irecv safely for the interleaved schedule (silently wrong).
        batch_p2p_comm=on_gpu,
        recompute_granularity="full" if options.recompute_activations else None,
        recompute_method="uniform" if options.recompute_activations else None,
        recompute_num_layers=1 if options.recompute_activations else None,
    )


class ValueHead(torch.nn.Module):
    """Critic head [hidden] -> [1], replicated on every TP rank; called like megatron's output layer."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, init_std: float) -> None:
        super().__init__()
        # Same CPU RNG stream on every TP rank of the last stage, so the replicas start identical.
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=dtype).normal_(0.0, init_std))

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        return torch.matmul(hidden_states, self.weight.t()), None


def build_model_chunks(arch: ModelArch, options: BuildOptions = BuildOptions()) -> list[torch.nn.Module]:
    """This rank's model chunks: one GPTModel per virtual pipeline stage (one without interleaving)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    config = transformer_config(arch, options)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    vocab = options.padded_vocab_size or arch.padded_vocab_size(tp)
    if vocab % tp or vocab < arch.vocab_size:
        raise ValueError(f"padded vocab size {vocab} must be >= {arch.vocab_size} and divisible by tp={tp}")
    if resolve_layer_spec(options.layer_spec) == "local":
        layer_spec = get_gpt_layer_local_spec(qk_layernorm=arch.features.qk_norm, normalization="RMSNorm")
    else:
        layer_spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.features.qk_norm)
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = None if vpp is None else vp_stage
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=vocab,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=arch.tie_word_embeddings and not options.value_head,
            position_embedding_type="rope",
            rotary_base=int(arch.rope_theta),
            vp_stage=stage,
        )
        # Megatron's built-in Llama-3 scaling hard-codes its constants; use the checkpoint's exact ones.
        model.rotary_pos_emb.inv_freq = rope_inv_freq(arch).to(model.rotary_pos_emb.inv_freq.device)
        if options.value_head and post:
            model.output_layer = ValueHead(arch.hidden_size, config.params_dtype, config.init_method_std)
        if cuda_available():
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks

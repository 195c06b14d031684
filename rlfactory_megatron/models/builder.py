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
    layer_spec: str = "auto"  # "auto" | "local_sdpa" | "local" | "transformer_engine"
    recompute_activations: bool = False
    sequence_parallel: bool = False
    padded_vocab_size: int | None = None  # keep a checkpoint's padding when loading it at another TP
    output_hidden_states: bool = False  # policy: last stage returns hidden states, not logits (fused log-prob)


def _transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


LAYER_SPECS = ("auto", "local_sdpa", "local", "transformer_engine")


def resolve_layer_spec(choice: str) -> str:
    """TE spec on GPU when TE is installed; otherwise megatron's local spec with torch's fused attention."""
    if choice == "auto":
        return "transformer_engine" if cuda_available() and _transformer_engine_available() else "local_sdpa"
    if choice == "transformer_engine" and not _transformer_engine_available():
        raise ValueError("model.layer_spec=transformer_engine but transformer_engine is not installed "
                         "(install with ./install.sh --gpu, or use model.layer_spec=local)")
    if choice not in LAYER_SPECS:
        raise ValueError(f"model.layer_spec must be one of {', '.join(LAYER_SPECS)}, not '{choice}'")
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
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
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


class HiddenStatesOutput(torch.nn.Module):
    """Stands in for megatron's LM output layer and returns its input, the final hidden states, so the
    loss computes log-probs from them and `lm_output_weight` without materializing [tokens, vocab] logits.

    It takes over the layer's `weight` (None on a tied first stage, where GPTModel passes the embedding)
    with the same name and TP sharding, so HF conversion and checkpoints do not see the swap.
    """

    def __init__(self, output_layer: torch.nn.Module) -> None:
        super().__init__()
        self.weight = output_layer.weight
        self.tp_group = output_layer.tp_group
        self.sequence_parallel = output_layer.sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # The full sequence, as the output layer would gather it. Its backward only splits: the
            # fused log-prob already all-reduces the hidden-state gradient over the TP group.
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self.tp_group
            )
        return hidden_states, None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        # As ColumnParallelLinear's: the weight's rows (the vocab) split across TP ranks.
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"],
        )


def lm_output_weight(model: torch.nn.Module) -> torch.Tensor:
    """The [V/tp, H] weight a last-stage GPTModel computes logits with: the embedding when tied."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


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
    spec_name = resolve_layer_spec(options.layer_spec)
    if spec_name.startswith("local"):
        layer_spec = get_gpt_layer_local_spec(qk_layernorm=arch.features.qk_norm, normalization="RMSNorm")
        if spec_name == "local_sdpa":
            from rlfactory_megatron.models.sdpa_attention import SDPACoreAttention

            layer_spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
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
        elif options.output_hidden_states and post:
            model.output_layer = HiddenStatesOutput(model.output_layer)
        if cuda_available():
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks

"""Build megatron-core GPTModel chunks for this rank from a ModelArch (policy LM or critic value head)."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlfactory_megatron.models.hf_arch import ModelArch, rope_inv_freq
from rlfactory_megatron.runtime.cpu_compat import allow_moe_without_transformer_engine, compute_device, cuda_available

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class MoEOptions:
    """A mixture-of-experts model's router settings (config `model.moe`; docs/moe.md)."""

    load_balancing: str = "none"  # none | aux_loss | seq_aux_loss
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    router_dtype: str = "fp32"  # fp32 | fp64
    freeze_router: bool = False


@dataclass(frozen=True)
class BuildOptions:
    params_dtype: str = "float32"
    value_head: bool = False  # critic: a [hidden -> 1] head instead of the LM head
    layer_spec: str = "auto"  # "auto" | "local_sdpa" | "local" | "transformer_engine"
    recompute: str = "none"  # one of RECOMPUTE (model.recompute, `auto` resolved by the memory plan)
    sequence_parallel: bool = False
    padded_vocab_size: int | None = None  # keep a checkpoint's padding when loading it at another TP
    output_hidden_states: bool = False  # policy: last stage returns hidden states, not logits (fused log-prob)
    moe: MoEOptions = MoEOptions()  # ignored by a dense model


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


def resolve_params_dtype(dtype: str, layer_spec: str, for_gpu: bool = False) -> str:
    """`model.params_dtype` for the layer spec the model is built with: `auto` is bfloat16 with
    Transformer-Engine layers and float32 elsewhere. The actor feeds TE packed (THD) sequences,
    for which TE's attention has no float32 kernel (flash and fused attention take 16-bit inputs
    only, the unfused one no THD): float32 there would fail at the first forward, so it is refused.
    `for_gpu`: as a GPU node with the GPU stack resolves it (TE layers for `auto`), wherever this runs."""
    if layer_spec == "auto":
        layer_spec = "transformer_engine" if for_gpu else resolve_layer_spec(layer_spec)
    transformer_engine = layer_spec == "transformer_engine"
    if dtype == "auto":
        return "bfloat16" if transformer_engine else "float32"
    if transformer_engine and dtype == "float32":
        where = " (model.layer_spec=auto picks it on a GPU with Transformer-Engine)" if layer_spec == "auto" else ""
        raise ValueError(f"model.params_dtype=float32 cannot train with model.layer_spec=transformer_engine{where}: "
                         "TE's attention has no float32 kernel for packed sequences; set model.params_dtype=bfloat16 "
                         "(or auto), or model.layer_spec=local_sdpa")
    return dtype


def fusions(layer_spec: str, on_gpu: bool) -> dict[str, bool]:
    """megatron's fused kernels where they run (each computes the function its unfused path does):
    on a GPU the fused SwiGLU (megatron's jit kernel) and, with apex's extension, weight gradients
    accumulated inside their GEMMs (megatron refuses that without apex); with Transformer-Engine
    layers TE's fused RoPE, which takes packed sequences' offsets on the device (megatron's unfused
    THD RoPE reads them with .tolist(): two host syncs per layer and per recompute). The masked
    softmax fusion serves megatron's own attention only (TE's has its own) and needs apex's
    kernels, the persistent layer norm is apex's LayerNorm (these models use RMSNorm): both off."""
    return {
        "bias_activation_fusion": on_gpu,
        "gradient_accumulation_fusion": on_gpu and importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None,
        "apply_rope_fusion": layer_spec == "transformer_engine",
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
    }


def moe_settings(arch: ModelArch, layer_spec: str, on_gpu: bool, options: MoEOptions = MoEOptions()) -> dict:
    """megatron's MoE fields for `arch` (none for a dense model). HF's router takes a softmax over
    all experts, then the top-k, renormalized when `norm_topk_prob`: megatron's top-k then softmax
    over the k is the same function, its pre-softmax (no renormalization) the other. Tokens travel
    by all-to-all on GPU; on CPU by all-gather, whose dispatcher asks nothing of CUDA streams."""
    from megatron.core import parallel_state

    if arch.moe is None:
        return {}
    return dict(
        num_moe_experts=arch.moe.num_experts,
        moe_router_topk=arch.moe.top_k,
        moe_ffn_hidden_size=arch.moe.expert_ffn_hidden_size,
        moe_router_pre_softmax=not arch.moe.norm_topk_prob,
        moe_grouped_gemm=layer_spec == "transformer_engine",  # TEGroupedMLP; the local spec's SequentialMLP
        moe_token_dispatcher_type="alltoall" if on_gpu else "allgather",
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
        moe_router_load_balancing_type=options.load_balancing,
        moe_aux_loss_coeff=options.aux_loss_coeff,
        moe_z_loss_coeff=options.z_loss_coeff or None,  # megatron's "off"
        moe_router_dtype=options.router_dtype,
    )


# Activation recompute, least first (model.recompute; the memory plan's `auto` picks the first that fits).
RECOMPUTE = ("none", "selective", "full")


def recompute_settings(recompute: str, arch: ModelArch) -> dict:
    """megatron's recompute fields: selective recomputes each layer's MLP (a MoE layer's experts),
    full every layer from its input, one layer at a time."""
    if recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if recompute == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["moe" if arch.moe else "mlp"])
    if recompute != "none":
        raise ValueError(f"model.recompute={recompute}: the builder takes one of {', '.join(RECOMPUTE)} "
                         "(auto is resolved by the memory plan at load)")
    return {}


def transformer_config(arch: ModelArch, options: BuildOptions):
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    dtype = _DTYPES[options.params_dtype]
    on_gpu = cuda_available()
    layer_spec = resolve_layer_spec(options.layer_spec)
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
        **fusions(layer_spec, on_gpu),
        **moe_settings(arch, layer_spec, on_gpu, options.moe),
        # gloo cannot batch isend/irecv safely for the interleaved schedule (silently wrong).
        batch_p2p_comm=on_gpu,
        # As megatron's own training sets it: a stage frees its output activations once sent, and
        # the backward pass calls the autograd engine directly, which also keeps cpu_compat's CUDA
        # mapping on for backward functions (torch.autograd.backward ran them without it).
        deallocate_pipeline_outputs=True,
        **recompute_settings(options.recompute, arch),
    )


def _whole_sequence(hidden_states: torch.Tensor, output_layer: torch.nn.Module) -> torch.Tensor:
    """The last layer's hidden states over the whole sequence, as megatron's output layer gathers
    them under sequence parallelism (each TP rank holds a part). Its backward only splits: what
    consumes them (the fused log-prob, which all-reduces their gradient over the TP group, or the
    replicated value head) gives every TP rank the whole gradient."""
    if not output_layer.sequence_parallel:
        return hidden_states
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False,
                                                group=output_layer.tp_group)


class ValueHead(torch.nn.Module):
    """Critic head [hidden] -> [1], replicated on every TP rank; replaces megatron's output layer
    (and takes its TP group and sequence-parallel setting)."""

    def __init__(self, output_layer: torch.nn.Module, hidden_size: int, dtype: torch.dtype, init_std: float) -> None:
        super().__init__()
        # Same CPU RNG stream on every TP rank of the last stage, so the replicas start identical.
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=dtype).normal_(0.0, init_std))
        self.tp_group = output_layer.tp_group
        self.sequence_parallel = output_layer.sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        return torch.matmul(_whole_sequence(hidden_states, self), self.weight.t()), None


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
        return _whole_sequence(hidden_states, self), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        # As ColumnParallelLinear's: the weight's rows (the vocab) split across TP ranks.
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"],
        )


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm as megatron's local spec builds it, also under sequence parallelism, which
    megatron's wrapper refuses only because a torch norm lacks the mark its weight needs: each TP
    rank then normalizes a part of the sequence, and megatron sums the gradients of weights marked
    `sequence_parallel` over the TP group (finalize_model_grads), as for apex's and TE's norms."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def _with_sequence_parallel_norms(layer_spec, config, vp_stage: int | None):
    """The local spec's norms replaced by SequenceParallelRMSNorm, the block's final norm included
    (megatron picks that one itself unless given the block's submodules)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer_spec.submodules.input_layernorm = SequenceParallelRMSNorm
    layer_spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    attention = layer_spec.submodules.self_attention.submodules
    if config.qk_layernorm:  # q/k norms see whole sequences; megatron sums their gradients over TP anyway
        attention.q_layernorm = attention.k_layernorm = SequenceParallelRMSNorm
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                      layer_norm=SequenceParallelRMSNorm)


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
    experts = arch.moe.num_experts if arch.moe else None
    if experts:
        allow_moe_without_transformer_engine()
    if spec_name.startswith("local"):
        layer_spec = get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=arch.features.qk_norm,
                                              normalization="RMSNorm")
        if spec_name == "local_sdpa":
            from rlfactory_megatron.models.sdpa_attention import SDPACoreAttention

            layer_spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    else:
        layer_spec = get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=bool(experts),
                                                                qk_layernorm=arch.features.qk_norm)
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = None if vpp is None else vp_stage
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        model = GPTModel(
            config=config,
            transformer_layer_spec=(_with_sequence_parallel_norms(layer_spec, config, stage)
                                    if options.sequence_parallel and spec_name.startswith("local") else layer_spec),
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
            model.output_layer = ValueHead(model.output_layer, arch.hidden_size, config.params_dtype,
                                           config.init_method_std)
        elif options.output_hidden_states and post:
            model.output_layer = HiddenStatesOutput(model.output_layer)
        if options.moe.freeze_router:
            for name, param in model.named_parameters():
                if name.endswith(".mlp.router.weight"):
                    param.requires_grad_(False)
        model.to(compute_device())
        chunks.append(model)
    return chunks

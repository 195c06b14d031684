"""What the model build turns on where a GPU is, checked on CPU with the CUDA and TE checks patched
in and megatron's TransformerConfig recorded (TE's fused kernels do not exist here to validate it)."""
from rlfactory_megatron.models import builder
from rlfactory_megatron.models.hf_arch import arch_from_hf_config

ARCH = arch_from_hf_config({"model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 64,
                            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                            "vocab_size": 512})


MOE_ARCH = arch_from_hf_config({"model_type": "qwen3_moe", "num_hidden_layers": 2, "hidden_size": 64,
                                "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "vocab_size": 512, "num_experts": 8, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "norm_topk_prob": True})


def built_config(monkeypatch, on_gpu: bool, layer_spec: str, arch=ARCH, moe=builder.MoEOptions()) -> dict:
    """transformer_config's keyword arguments to megatron's TransformerConfig on a (pretend) machine."""
    import megatron.core.transformer as mcore_transformer
    from megatron.core import parallel_state

    monkeypatch.setattr(builder, "cuda_available", lambda: on_gpu)
    monkeypatch.setattr(builder, "_transformer_engine_available", lambda: on_gpu)
    monkeypatch.setattr(mcore_transformer, "TransformerConfig", lambda **kwargs: kwargs)
    monkeypatch.setattr(parallel_state, "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", 1)
    monkeypatch.setattr(parallel_state, "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", 1)
    monkeypatch.setattr(parallel_state, "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE", 2)
    monkeypatch.setattr(parallel_state, "_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE", 1)
    return builder.transformer_config(arch, builder.BuildOptions(params_dtype="bfloat16", layer_spec=layer_spec,
                                                                 moe=moe))


def test_moe_dispatches_by_all_to_all_with_grouped_experts_on_gpu_and_by_all_gather_on_cpu(monkeypatch):
    gpu = built_config(monkeypatch, True, "auto", MOE_ARCH)
    assert gpu["moe_token_dispatcher_type"] == "alltoall" and gpu["moe_grouped_gemm"]  # TEGroupedMLP
    cpu = built_config(monkeypatch, False, "auto", MOE_ARCH)
    assert cpu["moe_token_dispatcher_type"] == "allgather" and not cpu["moe_grouped_gemm"]  # SequentialMLP
    for config in (gpu, cpu):
        assert (config["num_moe_experts"], config["moe_router_topk"], config["moe_ffn_hidden_size"]) == (8, 2, 32)
        assert config["expert_model_parallel_size"] == 2
        # norm_topk_prob: top-k, then a softmax over the k (= HF's renormalized top-k of the softmax)
        assert config["moe_router_pre_softmax"] is False
        assert config["moe_router_load_balancing_type"] == "none" and config["moe_router_dtype"] == "fp32"
    assert "num_moe_experts" not in built_config(monkeypatch, False, "auto")  # a dense model
    keys = builder.MoEOptions(load_balancing="seq_aux_loss", aux_loss_coeff=1e-3, z_loss_coeff=1e-4, router_dtype="fp64")
    chosen = built_config(monkeypatch, False, "auto", MOE_ARCH, keys)
    assert (chosen["moe_router_load_balancing_type"], chosen["moe_aux_loss_coeff"], chosen["moe_z_loss_coeff"],
            chosen["moe_router_dtype"]) == ("seq_aux_loss", 1e-3, 1e-4, "fp64")
    assert cpu["moe_z_loss_coeff"] is None and cpu["moe_aux_loss_coeff"] == 0.0  # both off by default


def test_grouped_expert_weights_are_named_with_global_expert_indices():
    # TEGroupedMLP (the GPU spec, not buildable here) keeps one weight per local expert in a shared
    # module; on EP rank r of 2 with 4 experts each, local expert 3 is HF's expert 4 * r + 3.
    from rlfactory_megatron.models.conversion import _COMPILED, hf_names_of

    def names(mcore_name):
        rule, match = next((rule, m) for pattern, rule in _COMPILED if (m := pattern.match(mcore_name)))
        return rule.split, hf_names_of(rule, match, {1: 5}, experts_per_rank=4, ep=2)

    assert names("decoder.layers.1.mlp.experts.linear_fc1.weight3") == ("gate_up", (
        ("model.layers.5.mlp.experts.3.gate_proj.weight", "model.layers.5.mlp.experts.3.up_proj.weight"),
        ("model.layers.5.mlp.experts.7.gate_proj.weight", "model.layers.5.mlp.experts.7.up_proj.weight")))
    assert names("decoder.layers.1.mlp.experts.linear_fc2.weight0") == ("row", (
        ("model.layers.5.mlp.experts.0.down_proj.weight",), ("model.layers.5.mlp.experts.4.down_proj.weight",)))
    assert names("decoder.layers.1.mlp.router.weight") == ("replicated", (("model.layers.5.mlp.gate.weight",),))


def test_item11_fusions_are_on_where_a_gpu_is_and_off_on_cpu(monkeypatch):
    gpu = built_config(monkeypatch, True, "auto")  # auto: Transformer-Engine layers
    assert gpu["apply_rope_fusion"] and gpu["bias_activation_fusion"]  # TE's THD RoPE: no .tolist() per layer
    assert gpu["gradient_accumulation_fusion"] is False  # needs apex's extension, not installed here
    assert not gpu["masked_softmax_fusion"] and not gpu["persist_layer_norm"]
    local_on_gpu = built_config(monkeypatch, True, "local_sdpa")
    assert local_on_gpu["bias_activation_fusion"] and not local_on_gpu["apply_rope_fusion"]
    cpu = built_config(monkeypatch, False, "auto")
    assert not any(cpu[key] for key in builder.fusions("local_sdpa", False))


def test_item11_finite_check_reads_the_gradient_buffer_without_copying_it(monkeypatch):
    # _finite_everywhere made two boolean copies of the whole fp32 gradient buffer per step
    # (~isfinite(grad)): a quarter of the buffer's memory, twice. It reduces in place now, and still
    # finds a NaN or an infinity anywhere.
    import types

    import torch
    import torch.distributed as dist

    from rlfactory_megatron.actor.model import MegatronModel

    grad = torch.zeros(1 << 20)
    engine = object.__new__(MegatronModel)
    engine.chunks = [types.SimpleNamespace(buffers=[types.SimpleNamespace(grad_data=grad)])]
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        assert engine._finite_everywhere([])
    largest = max(event.cpu_memory_usage for event in prof.key_averages())
    assert largest < grad.numel() // 16, largest  # a bool copy would be grad.numel() bytes
    for bad in (float("nan"), float("inf"), -float("inf")):
        grad[12345] = bad
        assert not engine._finite_everywhere([])
        grad[12345] = 0.0

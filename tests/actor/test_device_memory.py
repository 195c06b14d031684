"""Device memory on the Megatron side. actor.offload / critic.offload: a model's parameters,
gradients and optimizer states go to host memory and back (on CPU, host to host: the same code),
leaving nothing on the device while away, bit for bit the same on return, and the next update
the same as without the round trip. The memory plan: the parameters each rank really holds, and
its activation term against what a CPU model's backward pass really keeps."""

import pytest
import torch

import actor_workers

from rlfactory_megatron.runtime.distributed import spawn_local_workers


# bf16: fp32 main parameters beside the model's; tp=pp=2: split modules on two stages (the plan's
# counts per stage; the actor alone goes and comes back); dp=2 with the distributed optimizer:
# its state sharded over DP ranks.
EVERY_MODEL = ("actor", "critic", "reference")


@pytest.mark.parametrize("tp,pp,dp,dtype,distributed_optimizer,round_trips", [
    (1, 1, 1, "bfloat16", False, EVERY_MODEL), (2, 2, 1, "float32", False, ("actor",)),
    (1, 1, 2, "bfloat16", True, EVERY_MODEL)])
def test_offload_round_trip_is_bit_exact_and_the_next_update_the_same(tiny_hf_dirs, tp, pp, dp, dtype,
                                                                     distributed_optimizer, round_trips):
    results = spawn_local_workers(actor_workers.offload_worker, tp * pp * dp, tiny_hf_dirs["qwen3"], tp, pp, dtype,
                                  distributed_optimizer, round_trips)
    for rank, out in enumerate(results):
        for name in round_trips:
            result = out[name]
            assert result["bytes"] > 0 and result["freed"], (rank, name, result)
            if name != "reference":
                assert result["kept_params"] and result["freed_rest"], (rank, name, result)
            assert result["params_only"], (rank, name, result)
            assert result["exact"] and result["next_update_same"], (rank, name, result)
        for name, (counted, planned) in out["parameters"].items():
            assert counted == planned, (rank, name, counted, planned)


@pytest.mark.parametrize("family,cp", [("qwen2", 1), ("qwen3", 1), ("qwen3", 2)])
def test_the_plans_activations_are_what_the_backward_pass_keeps(tmp_path, family, cp):
    # A shape where activations dominate (ffn 2.75 x hidden, GQA) at a 512-token budget. The plan
    # counts the GPU path (TE layers, flash attention over the pack); CPU's local_sdpa spec keeps
    # somewhat more (the packed SDPA's gathered q/k/v and a second copy of the attention output),
    # so the plan must count most of it, and not more. At cp=2 each rank keeps its half, and its
    # attention only its own keys and values (the whole sequence's travel, and travel again).
    from rlfactory_megatron.models.tiny import make_tiny_hf_model

    hf_dir = make_tiny_hf_model(family, tmp_path / family, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                                num_attention_heads=8, num_key_value_heads=2, head_dim=32, vocab_size=1024)
    for out in spawn_local_workers(actor_workers.saved_activations_worker, cp, str(hf_dir), 512, cp):
        assert 0.7 * out["saved"] <= out["planned"] <= out["saved"], out


def test_offload_pins_one_flat_host_buffer_per_kind():
    # Per-tensor pinned copies cost up to twice the state (torch's pinned allocator rounds each to a
    # power of two and keeps it); one flat buffer per kind, at the state's exact size, serves
    # every step. Sizes not powers of two, a view sharing its storage, two steps.
    from rlfactory_megatron.actor.offload import HostOffload

    def state():
        return {"params": [weight, weight[1:], bias], "grads": [grad], "optimizer": [moment, step_size]}

    weight, bias, grad = torch.randn(37, 3), torch.randn(5), torch.randn(111)
    moment, step_size = torch.randn(77, dtype=torch.float64), torch.randn(3, dtype=torch.bfloat16)
    expected = {"params": 37 * 3 * 4 + 5 * 4, "optimizer": 77 * 8 + 3 * 2}
    offload, seen = HostOffload(state), []
    for step in range(2):
        before = [t.clone() for t in (weight, bias, moment, step_size)]
        assert offload.offload() == sum(expected.values()) + 111 * 4
        buffers = offload.host_buffers()
        assert {kind: b.untyped_storage().nbytes() for kind, b in buffers.items()} == expected, step
        seen.append({kind: b.data_ptr() for kind, b in buffers.items()})
        offload.onload()
        assert all(torch.equal(a, b) for a, b in zip(before, (weight, bias, moment, step_size)))
        assert not grad.any()
        for t in (weight, moment):
            t.add_(1)
    assert seen[0] == seen[1]

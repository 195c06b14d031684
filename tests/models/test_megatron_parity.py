"""Megatron models built from HF checkpoints compute what transformers computes, at every TP/PP(/EP) split."""
import pytest
import torch

from rlfactory_megatron.models.hf_checkpoint import iter_safetensors
from rlfactory_megatron.models.parity import parity_worker
from rlfactory_megatron.runtime.distributed import ParallelSizes, spawn_local_workers

# (tp, pp, vpp, ep, etp); a layout with expert parallelism, or an expert TP of its own, checks the MoE model only.
LAYOUTS = [(1, 1, None, 1, None), (2, 1, None, 1, None), (1, 2, None, 1, None), (2, 2, None, 1, None),
           (1, 2, 2, 1, None), (1, 1, None, 2, None), (2, 1, None, 2, 1)]
MOE_MODELS = ("qwen3_moe",)


# tp2-pp1-ep2-etp1 is issue 53's item 9 (parallel.etp): 2 ranks, TP 2 for the dense layers, each expert
# whole on one of them (EP 2 within the TP group).
@pytest.mark.parametrize("tp,pp,vpp,ep,etp", LAYOUTS, ids=[
    f"tp{t}-pp{p}" + (f"-vpp{v}" if v else "") + (f"-ep{e}" if e > 1 else "") + (f"-etp{x}" if x else "")
    for t, p, v, e, x in LAYOUTS])
def test_logits_loss_and_gradients_equal_transformers(tiny_hf_dirs, tmp_path, tp, pp, vpp, ep, etp):
    names = sorted(n for n in tiny_hf_dirs if (ep == 1 and etp is None) or n in MOE_MODELS)
    exports = [str(tmp_path / f"export_{n}") for n in names]
    world = ParallelSizes(tp, pp, vpp, ep=ep, etp=etp).smallest_world
    per_rank = spawn_local_workers(parity_worker, world, [tiny_hf_dirs[n] for n in names], tp, pp, vpp,
                                   exports, ep, etp)
    for rank_results in per_rank:
        for name, result in zip(names, rank_results):
            assert result["grad_names_missing"] == [], name
            assert result["grad_max_diff"] <= 1e-5, (name, result)
            if "logits_max_diff" in result:  # last pipeline stage
                # The MoE model's acceptance bound (its logits are checked as tightly as they come out).
                assert result["logits_max_diff"] <= (1e-5 if name in MOE_MODELS else 1e-4), (name, result)
                assert result["loss_diff"] <= 1e-5, (name, result)
    last_stage_reports = sum("logits_max_diff" in r[0] for r in per_rank)
    assert last_stage_reports == world // pp  # every TP (and data-parallel) rank of the last stage compared logits

    # Export of the sharded model: HF -> Megatron(tp, pp) -> HF is bit-identical, tied embeddings included.
    for name, export in zip(names, exports):
        original = dict(iter_safetensors(tiny_hf_dirs[name]))
        exported = dict(iter_safetensors(export))
        assert sorted(exported) == sorted(original), name
        for key, tensor in original.items():
            assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), (name, key)

"""Check a megatron model against its HF original: logits, loss and gradients of one step.

Runs in every rank of a (tp, pp[, vpp]) job (`rlf-convert check` spawns them); used by the
test suite and by users who want proof that a conversion is exact on their checkpoint.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlfactory_megatron.models.builder import BuildOptions, build_model_chunks
from rlfactory_megatron.models.conversion import iter_hf_tensors, load_hf_weights
from rlfactory_megatron.models.hf_arch import load_arch
from rlfactory_megatron.models.hf_checkpoint import write_safetensors_shards
from rlfactory_megatron.models.logprobs import vocab_parallel_log_probs
from rlfactory_megatron.models.pipeline import forward_backward, gather_vocab_parallel
from rlfactory_megatron.runtime.cpu_compat import compute_device
from rlfactory_megatron.runtime.distributed import ParallelSizes, destroy_distributed, init_distributed


def _hf_reference(hf_dir: str, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """HF's logits, loss and gradients, the gradients under the checkpoint's names (transformers
    keeps a MoE layer's experts fused in memory, the checkpoint has one tensor per expert)."""
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    logits = model(input_ids).logits
    loss = -torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None]).mean()
    loss.backward()
    grads = revert_weight_conversion(model, {name: p.grad for name, p in model.named_parameters()})
    return logits.detach(), loss.detach(), grads


def _finalize_grads(chunks: list[torch.nn.Module]) -> None:
    """What megatron's finalize_model_grads does without DDP: sum partial gradients across ranks.

    q/k layernorms see only this TP rank's heads, and under sequence parallelism the weights
    megatron marks `sequence_parallel` (norms, a MoE router) only its part of the sequence;
    with PP > 1 the first and last stage each hold a copy of tied embeddings.
    """
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                if "q_layernorm" in name or "k_layernorm" in name or getattr(param, "sequence_parallel", False):
                    dist.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())
    # An expert's gradient as megatron's DDP makes it: summed over the ranks holding the same
    # expert shard (expert data parallel: at etp < tp the TP ranks, each with its part of the
    # sequence, too) and divided by the data-parallel size, since every data-parallel replica here
    # runs the same batch.
    replicas = parallel_state.get_data_parallel_world_size()
    for chunk in chunks:
        for param in chunk.parameters():
            if not getattr(param, "allreduce", True):
                dist.all_reduce(param.grad, group=parallel_state.get_expert_data_parallel_group())
                param.grad /= replicas
    if parallel_state.get_pipeline_model_parallel_world_size() == 1 or not parallel_state.is_rank_in_embedding_group():
        return
    for chunk in chunks:
        if chunk.share_embeddings_and_output_weights and (chunk.pre_process or chunk.post_process):
            weight = chunk.shared_embedding_or_output_weight()
            dist.all_reduce(weight.grad, group=parallel_state.get_embedding_group())


def check_parity(hf_dir: str, export_dir: str | None = None, seq_len: int = 16, batch_size: int = 2,
                 seed: int = 0) -> dict[str, Any]:
    """Max abs differences vs HF for logits (last stage), loss and every gradient; optionally export.

    Collective over an initialized (tp, pp[, vpp]) job.
    """
    from megatron.core import parallel_state

    arch = load_arch(hf_dir)
    # megatron trains MoE layers under TP only with sequence parallelism (its MoE layer refuses otherwise).
    tp = parallel_state.get_tensor_model_parallel_world_size()
    chunks = build_model_chunks(arch, BuildOptions(sequence_parallel=arch.moe is not None and tp > 1))
    load_hf_weights(chunks, arch, hf_dir)
    input_ids = torch.randint(0, arch.vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(seed))
    # One sample per micro-batch: exercises gradient accumulation and the (V)PP schedules.
    device = compute_device()
    micro_batches = [{"input_ids": input_ids[i : i + 1].to(device),
                      "position_ids": torch.arange(seq_len, device=device)[None]} for i in range(batch_size)]

    def loss_fn(batch, output):
        log_probs = vocab_parallel_log_probs(output[:, :-1], batch["input_ids"][:, 1:], arch.vocab_size)
        full_logits = gather_vocab_parallel(output.detach())[..., : arch.vocab_size]
        loss = -log_probs.mean()
        # clone: the schedule scales the returned loss in place.
        return loss, {"loss": loss.detach().clone(), "logits": full_logits}

    outputs = forward_backward(chunks, micro_batches, loss_fn, forward_only=False,
                               seq_length=seq_len, micro_batch_size=1)
    _finalize_grads(chunks)
    ref_logits, ref_loss, ref_grads = _hf_reference(hf_dir, input_ids)
    result: dict[str, Any] = {"rank": dist.get_rank(), "hf_dir": hf_dir}
    if outputs:
        logits = torch.cat([out["logits"] for out in outputs]).cpu()
        loss = torch.stack([out["loss"] for out in outputs]).mean()
        result["logits_max_diff"] = (logits - ref_logits).abs().max().item()
        result["loss_diff"] = abs(loss.item() - ref_loss.item())
    grad_diffs = {name: (grad.cpu() - ref_grads[name]).abs().max().item()
                  for name, grad in iter_hf_tensors(chunks, arch, source=lambda p: p.grad)}
    result["grad_max_diff"] = max(grad_diffs.values())
    result["grad_names_missing"] = sorted(set(ref_grads) - set(grad_diffs))
    if export_dir is not None:
        tensors = iter_hf_tensors(chunks, arch)
        if dist.get_rank() == 0:
            write_safetensors_shards(tensors, export_dir)
        else:
            for _ in tensors:
                pass
    return result


def parity_worker(hf_dirs: list[str], tp: int, pp: int, vpp: int | None = None,
                  export_dirs: list[str | None] | None = None, ep: int = 1,
                  etp: int | None = None) -> list[dict[str, Any]]:
    """One rank of a parity job over several checkpoints (process groups are set up once)."""
    init_distributed(ParallelSizes(tp, pp, vpp, ep=ep, etp=etp))
    try:
        exports = export_dirs or [None] * len(hf_dirs)
        return [check_parity(hf_dir, export) for hf_dir, export in zip(hf_dirs, exports)]
    finally:
        destroy_distributed()


def job_parity(hf_dir: str, tp: int, pp: int, vpp: int | None = None, ep: int = 1,
               etp: int | None = None) -> list[dict[str, Any]]:
    """One rank of a parity check of one checkpoint; returns every rank's result, so that under a
    launcher (one process per rank) any rank can judge the whole job: a pipeline rank without the
    last stage has no logits, another rank's gradients may be the worst."""
    init_distributed(ParallelSizes(tp, pp, vpp, ep=ep, etp=etp))
    try:
        mine = check_parity(hf_dir)
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return every
    finally:
        destroy_distributed()

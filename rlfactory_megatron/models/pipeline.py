"""Run micro-batches through this rank's model chunks with megatron's schedules (so PP and VPP work).

A micro-batch is a dict with `input_ids` and `position_ids` ([b, s]) plus whatever the
loss needs; `loss_fn(batch, output) -> (loss, metrics)` runs on the last stage, where
`output` is the model's vocab-parallel logits, its final hidden states (fused log-prob path),
or values (critic).
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch

LossFn = Callable[[dict[str, Any], torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]


def forward_backward(
    chunks: list[torch.nn.Module],
    micro_batches: list[dict[str, Any]],
    loss_fn: LossFn,
    *,
    forward_only: bool,
    seq_length: int,
    micro_batch_size: int,
) -> list[dict[str, Any]]:
    """One pass over `micro_batches`; returns the per-micro-batch metrics (last pipeline stage only)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(
            batch["input_ids"],
            batch["position_ids"],
            batch.get("attention_mask"),
            packed_seq_params=batch.get("packed_seq_params"),
        )
        return output, partial(loss_fn, batch)

    data_iterators = [iter(micro_batches) for _ in chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data_iterators if len(chunks) > 1 else data_iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(micro_batches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def gather_vocab_parallel(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocab logits from TP shards (for tests and small-vocab evaluation only)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(logits)

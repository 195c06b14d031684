"""Loss aggregation modes: how a [batch, tokens] loss matrix becomes one scalar."""
from collections.abc import Callable

import torch

from rlfactory_megatron.algorithms.masked import masked_sum
from rlfactory_megatron.registry import Registry

LossAggregation = Callable[..., torch.Tensor]
LOSS_AGGREGATIONS: Registry[LossAggregation] = Registry("loss aggregation mode")


def _seq_count(mask: torch.Tensor) -> torch.Tensor:
    # Rows without a single valid token (padding rows of a packed batch) must not dilute the mean.
    return (mask.bool().sum(-1) > 0).sum().clamp(min=1)


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean(loss: torch.Tensor, mask: torch.Tensor, *, num_units: float | None = None) -> torch.Tensor:
    """Sum of valid token losses / number of valid tokens (`num_units` overrides the count)."""
    count = mask.bool().sum().clamp(min=1) if num_units is None else num_units
    return masked_sum(loss, mask) / count


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor, *, num_units: float | None = None) -> torch.Tensor:
    """Mean over sequences of each sequence's token-loss sum."""
    count = _seq_count(mask) if num_units is None else num_units
    return masked_sum(loss, mask, dim=-1).sum() / count


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, *, num_units: float | None = None) -> torch.Tensor:
    """Mean over sequences of each sequence's mean token loss."""
    per_seq = masked_sum(loss, mask, dim=-1) / mask.bool().sum(-1).clamp(min=1)
    count = _seq_count(mask) if num_units is None else num_units
    return per_seq.sum() / count


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss: torch.Tensor, mask: torch.Tensor, *, num_units: float | None = None, norm_length: float | None = None
) -> torch.Tensor:
    """Dr.GRPO: mean over sequences of token-loss sum / a constant length (default: mask width).

    A constant divisor (the generation budget) removes GRPO's bias toward long wrong answers.
    """
    length = mask.shape[-1] if norm_length is None else norm_length
    return seq_mean_token_sum(loss, mask, num_units=num_units) / length


def aggregate_loss(
    loss: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", *, num_units: float | None = None, **options
) -> torch.Tensor:
    """Reduce a per-token loss with the named mode.

    `num_units` is the global number of tokens (token-mean) or sequences (seq-mean-*)
    when this batch is one micro-batch of a larger mini-batch; default: this batch's own.
    """
    return LOSS_AGGREGATIONS.get(mode)(loss, mask, num_units=num_units, **options)

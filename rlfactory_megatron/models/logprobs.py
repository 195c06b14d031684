"""Per-token log-probs from vocab-parallel logits, without gathering the vocabulary on one rank."""
from __future__ import annotations

import torch


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Megatron pads the vocab to split it across TP ranks; padded columns must get no probability."""
    from megatron.core import parallel_state

    shard = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * shard
    if start + shard <= vocab_size:
        return logits
    columns = torch.arange(start, start + shard, device=logits.device)
    return logits.masked_fill(columns >= vocab_size, float("-inf"))


def vocab_parallel_log_probs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log p(target) per position; logits are this TP rank's vocab shard, [..., V/tp]."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # megatron's cross entropy works in place on its input: hand it a private fp32 copy.
    logits = mask_padded_vocab(logits.to(torch.float32, copy=True), vocab_size)
    return -vocab_parallel_cross_entropy(logits, targets)


def vocab_parallel_entropy(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Entropy of softmax(logits) per position from this rank's vocab shard; differentiable under TP."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    logits = mask_padded_vocab(logits.float(), vocab_size)
    shift = logits.detach().max(dim=-1, keepdim=True).values
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    shifted = logits - shift
    exp = shifted.exp()
    # H = log Z - E_p[z - shift]: both sums are partial per rank and all-reduced (identity backward).
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(-1))
    weighted = reduce_from_tensor_model_parallel_region((exp * shifted.masked_fill(exp == 0, 0.0)).sum(-1))
    return sum_exp.log() - weighted / sum_exp

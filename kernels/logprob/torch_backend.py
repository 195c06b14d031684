"""PyTorch implementation of the two per-chunk steps of the fused log-prob: stats and logit gradients."""
import torch

from rlfactory_megatron.kernels.logprob.stats import SoftmaxStats


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, inv_temp: float) -> torch.Tensor:
    if inv_temp != 1.0:
        hidden = hidden * inv_temp  # scale [C, H], not the [C, V] product
    return (hidden @ weight.t()).float()


def _local_targets(targets: torch.Tensor, vocab_start: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    local = targets.long() - vocab_start
    in_shard = (local >= 0) & (local < vocab_size)
    return local.clamp(0, vocab_size - 1), in_shard


def local_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    inv_temp: float,
    chunk_size: int,
) -> SoftmaxStats:
    """Softmax stats of this rank's vocab shard, token chunk by token chunk (two [C, V/tp] buffers)."""
    parts = []
    for start in range(0, hidden.shape[0], chunk_size):
        z = _chunk_logits(hidden[start : start + chunk_size], weight, inv_temp)
        idx, in_shard = _local_targets(targets[start : start + chunk_size], vocab_start, weight.shape[0])
        z_max = z.amax(-1)
        z.sub_(z_max[:, None])
        e = torch.exp(z)
        target = torch.where(in_shard, z.gather(-1, idx[:, None]).squeeze(-1) + z_max, torch.zeros_like(z_max))
        sum_exp = e.sum(-1)
        # In place (no third [C, V] buffer), and not einsum: its CPU kernel sums 150k-long rows to ~1e-5.
        sum_exp_shifted = e.mul_(z).sum(-1)
        parts.append(tuple(x.double() for x in (z_max, sum_exp, sum_exp_shifted, target)))
    return SoftmaxStats(*(torch.cat(p) for p in zip(*parts)))


def grad_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    log_z: torch.Tensor,
    mean_logit: torch.Tensor,
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor,
    vocab_start: int,
    inv_temp: float,
) -> torch.Tensor:
    """dL/dz [C, V/tp] for one token chunk, from recomputed logits.

    d logp/dz_v = 1[v = y] - p_v and d entropy/dz_v = -p_v (z_v - E_p[z]).
    """
    z = _chunk_logits(hidden, weight, inv_temp)
    p = torch.sub(z, log_z[:, None]).exp_()
    # -p (g_lp + g_ent (z - mean)) = p (z * slope + offset): two in-place passes over [C, V] instead of four.
    slope, offset = -grad_entropy, grad_entropy * mean_logit - grad_logp
    z.mul_(slope[:, None]).add_(offset[:, None]).mul_(p)
    del p
    idx, in_shard = _local_targets(targets, vocab_start, weight.shape[0])
    rows = torch.nonzero(in_shard).squeeze(-1)
    z[rows, idx[rows]] += grad_logp[rows]
    return z

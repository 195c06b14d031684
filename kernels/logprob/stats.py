"""Per-token softmax statistics of a vocabulary slice, and how slices combine.

A slice (a chunk of vocab, or one TP rank's shard) is summarised by its max logit m, the
shifted sums s = sum e^(z-m) and b = sum e^(z-m) (z-m), and the target's logit if it lives
there. Slices merge exactly (online softmax), so log-prob and entropy never need [T, V].
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class SoftmaxStats:
    """All fields [T] float64: the sums run over up to V/tp terms, and O(T) memory is cheap."""

    max: torch.Tensor  # [T]
    sum_exp: torch.Tensor  # [T] sum e^(z - max)
    sum_exp_shifted: torch.Tensor  # [T] sum e^(z - max) * (z - max)
    target_logit: torch.Tensor  # [T] z[target] if target is in this slice, else 0

    @classmethod
    def empty(cls, tokens: int, device: torch.device) -> "SoftmaxStats":
        """Stats of a slice with no vocab entries (a TP shard that is all padding): merging it is a no-op."""
        zeros = torch.zeros(tokens, dtype=torch.float64, device=device)
        return cls(torch.full_like(zeros, float("-inf")), zeros, zeros, zeros)

    def rescaled(self, new_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, b) re-expressed relative to `new_max` >= self.max."""
        scale = torch.exp(self.max - new_max)
        # A slice with no entries has max -inf and s = 0; keep its (-inf) * 0 from becoming nan.
        shift = torch.where(self.sum_exp > 0, self.max - new_max, torch.zeros_like(new_max))
        return self.sum_exp * scale, (self.sum_exp_shifted + shift * self.sum_exp) * scale

    def merged(self, dim: int = 0) -> "SoftmaxStats":
        """Merge slices stacked along `dim` (e.g. Triton's vocab splits) into one."""
        new_max = self.max.amax(dim, keepdim=True)
        s, b = self.rescaled(new_max)
        return SoftmaxStats(new_max.squeeze(dim), s.sum(dim), b.sum(dim), self.target_logit.sum(dim))

    def all_reduced(self, group: dist.ProcessGroup | None) -> "SoftmaxStats":
        """Merge the vocab shards held by the ranks of a tensor-parallel group (two all-reduces)."""
        if group is None or dist.get_world_size(group) == 1:
            return self
        new_max = self.max.clone()
        dist.all_reduce(new_max, op=dist.ReduceOp.MAX, group=group)
        s, b = self.rescaled(new_max)
        sums = torch.stack([s, b, self.target_logit])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        return SoftmaxStats(new_max, sums[0], sums[1], sums[2])

    def finalize(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 (log-prob of target, entropy, log Z, E_p[z]) from full-vocabulary stats."""
        log_sum = torch.log(self.sum_exp)
        mean_shifted = self.sum_exp_shifted / self.sum_exp
        log_z = self.max + log_sum
        outputs = (self.target_logit - log_z, log_sum - mean_shifted, log_z, self.max + mean_shifted)
        return tuple(x.float() for x in outputs)

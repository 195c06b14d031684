"""Context parallelism (CP) over packed THD sequences: which positions of a pack each rank of the
CP group holds, and the all-gathers that bring per-position tensors back to the whole pack.

The split is megatron's load balancing (as Transformer-Engine's THD attention and megatron's
RoPE expect it): every sequence, its length a multiple of 2 x cp, is cut into 2 x cp chunks and
rank r keeps chunks r and 2cp-1-r, so each rank holds as much causal-attention work.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def split_positions(bounds: list[int], size: int, device: torch.device | None = None) -> torch.Tensor:
    """[size, positions / size]: row r lists the pack positions CP rank r holds, in its local order
    (sequence by sequence, chunk r then chunk 2 x size - 1 - r). `bounds`: the THD sequence
    boundaries of the pack (cu_seqlens), every length a multiple of 2 x size."""
    rows: list[list[torch.Tensor]] = [[] for _ in range(size)]
    for start, end in zip(bounds[:-1], bounds[1:]):
        if (end - start) % (2 * size):
            raise ValueError(f"a packed sequence of {end - start} positions cannot be split over a context-parallel "
                             f"group of {size}: its length must be a multiple of {2 * size}")
        chunk = (end - start) // (2 * size)
        for rank in range(size):
            for index in (rank, 2 * size - 1 - rank):
                rows[rank].append(torch.arange(start + index * chunk, start + (index + 1) * chunk, device=device))
    return torch.stack([torch.cat(row) if row else torch.zeros(0, dtype=torch.long, device=device) for row in rows])


def all_gather_positions(local: torch.Tensor, layout: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole pack along dim 0 from every rank's `local` positions (`layout` from split_positions)."""
    parts = [torch.empty_like(local) for _ in range(layout.shape[0])]
    dist.all_gather(parts, local.contiguous(), group=group)
    full = local.new_empty((layout.numel(), *local.shape[1:]))
    full[layout.flatten()] = torch.cat(parts)
    return full


class _GatherPositions(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, layout, rank, group):
        ctx.positions = layout[rank]
        return all_gather_positions(local, layout, group)

    @staticmethod
    def backward(ctx, grad_full):
        return grad_full[ctx.positions], None, None, None


@dataclass(frozen=True)
class ContextSplit:
    """How a pack's positions are split over a CP group, and which part this rank holds."""

    layout: torch.Tensor  # [size, positions / size], from split_positions
    rank: int
    group: dist.ProcessGroup

    @classmethod
    def of(cls, bounds: list[int], group: dist.ProcessGroup, device: torch.device | None = None) -> "ContextSplit":
        return cls(split_positions(bounds, dist.get_world_size(group), device), dist.get_rank(group), group)

    @property
    def positions(self) -> torch.Tensor:
        """The pack positions this rank holds, in its local order."""
        return self.layout[self.rank]

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The whole pack along dim 0 from every rank's part, for per-position outputs that every
        rank of the group turns into the same loss. Backward: this rank's positions of the
        gradient, not their sum over the group, so that each position's gradient counts once (megatron
        scales the loss by the CP size and DDP averages over data x context parallel ranks)."""
        return _GatherPositions.apply(local, self.layout, self.rank, self.group)

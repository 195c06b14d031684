"""Rank bodies for the DP advantage tests (importable by spawned processes)."""
import torch
import torch.distributed as dist

from rlfactory_megatron.algorithms import compute_advantages


def batch(seed: int = 0, rows: int = 12, width: int = 9, group: int = 4):
    """Rewards on each row's last valid token, values, masks with a gap (a tool observation)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    mask[:, 1] = 0
    rewards = torch.zeros(rows, width)
    scores = torch.randint(0, 3, (rows,), generator=gen).float() * 0.5
    scores[:group] = 0.9  # one group scored all alike
    rewards[torch.arange(rows), lengths - 1] = scores
    values = torch.randn(rows, width, generator=gen)
    return rewards, mask, values, torch.arange(rows) // group


def split_worker(name: str, mine_by_rank: list[list[int]]) -> torch.Tensor:
    """`name`'s advantages of this rank's rows (`mine_by_rank[rank]`), the batch split over the ranks."""
    dist.init_process_group("gloo")
    try:
        rewards, mask, values, groups = batch()
        mine = torch.tensor(mine_by_rank[dist.get_rank()], dtype=torch.long)
        out = compute_advantages(name, rewards[mine], mask[mine], values=values[mine], group_index=groups[mine],
                                 dp_group=dist.group.WORLD)
        return out.advantages
    finally:
        dist.destroy_process_group()

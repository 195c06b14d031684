"""Fused log-prob/entropy at tp=2 (two gloo processes, each holding its vocab shard) == naive on the full vocab."""
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rlfactory_megatron.runtime.distributed import spawn_local_workers

CASES = [
    # T, V, H, chunk_size, temperature
    (37, 100, 16, 8, 1.0),
    (64, 258, 32, 64, 0.7),
    (101, 1000, 24, 33, 1.0),
    (5, 64, 8, 100, 1.3),
]


def _worker() -> None:
    sys.path.insert(0, str(Path(__file__).parent))  # spawned children re-import this module's helpers
    from logprob_cases import assert_matches_naive

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        for T, V, H, chunk, temp in CASES:
            assert_matches_naive(T, V, H, chunk_size=chunk, temperature=temp, tp_group=dist.group.WORLD, rank=rank, world=world)
        # Padded vocab: rank 1's shard is part padding, then all padding (its stats are empty).
        for T, V, vocab_size in [(37, 256, 200), (20, 64, 30)]:
            assert_matches_naive(T, V, 16, chunk_size=8, tp_group=dist.group.WORLD, rank=rank, world=world, vocab_size=vocab_size)
        assert_matches_naive(
            9, 152064, 32, chunk_size=4, tp_group=dist.group.WORLD, rank=rank, world=world, reference_dtype=torch.float64
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_tp2_matches_naive():
    spawn_local_workers(_worker, 2)

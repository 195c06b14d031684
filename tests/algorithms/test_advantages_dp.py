"""Advantages of a batch split over DP ranks (each holding some rows, a group's samples on
several ranks) equal those of the whole batch on one rank, for every estimator: group baselines
and whitening are the batch's."""

import pytest
import torch

import dp_workers

from rlfactory_megatron.algorithms import compute_advantages
from rlfactory_megatron.algorithms.advantages import ADVANTAGE_ESTIMATORS
from rlfactory_megatron.runtime.distributed import spawn_local_workers

# Interleaved, so every group of 4 has samples on both ranks; rank 1 holds more rows than rank 0.
SPLIT = [[0, 3, 5, 8, 10], [1, 2, 4, 6, 7, 9, 11]]


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_advantages_over_dp_ranks_equal_the_whole_batchs(name):
    rewards, mask, values, groups = dp_workers.batch()
    whole = compute_advantages(name, rewards, mask, values=values, group_index=groups).advantages
    parts = spawn_local_workers(dp_workers.split_worker, 2, name, SPLIT)
    for rows, part in zip(SPLIT, parts):
        assert torch.allclose(part, whole[rows], atol=1e-6), name
    if name != "gae" and name != "reinforce++":  # the group that scored all alike teaches nothing
        assert (whole[:4] == 0).all()

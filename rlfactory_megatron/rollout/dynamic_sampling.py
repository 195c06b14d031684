"""DAPO's dynamic sampling: groups whose samples all scored the same have zero advantage and teach
nothing, so they are dropped and further prompts rolled out until enough groups are informative."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from rlfactory_megatron.rollout.prompts import PromptRecord
from rlfactory_megatron.rollout.rows import Rollouts

if TYPE_CHECKING:
    from rlfactory_megatron.rollout.generator import RolloutGenerator


def informative_rollouts(generator: RolloutGenerator, draw: Callable[[], list[PromptRecord]], step: int, wanted: int,
                         group_size: int, max_refill_rounds: int) -> Rollouts:
    """Roll out `draw()`'s prompts, keep groups with unequal rewards, and draw again (at most
    `max_refill_rounds` more times) until `wanted` groups are kept; the result carries the
    rewards already computed and the counts (rollout/groups_kept, groups_seen, refill_rounds).
    With nothing informative at all, the last draw is trained on (zero advantages)."""
    rollouts = generator.rollout(draw(), step)
    kept: list[tuple[Rollouts, list[int]]] = []
    groups = seen = rounds = 0
    while True:
        scores = np.asarray(generator.rewards(rollouts).scores).reshape(-1, group_size)  # the same on every rank
        seen += len(scores)
        informative = [g for g in range(len(scores)) if np.ptp(scores[g]) > 0][: wanted - groups]
        if informative:
            kept.append((rollouts, [g * group_size + k for g in informative for k in range(group_size)]))
            groups += len(informative)
        if groups >= wanted or rounds >= max_refill_rounds:
            break
        rounds += 1
        # Further rows are numbered on, so their sampling seeds never repeat the step's earlier ones.
        rollouts = generator.rollout(draw(), step, first_row=seen * group_size)
    if not kept:
        kept = [(rollouts, list(range(len(rollouts.summaries))))]
    final = Rollouts.of_rows(kept)
    final.extra_stats.update({"rollout/groups_kept": float(groups), "rollout/groups_seen": float(seen),
                              "rollout/refill_rounds": float(rounds)})
    return final

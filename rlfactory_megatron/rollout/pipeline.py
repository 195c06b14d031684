"""Rollout batches generated ahead of training (asynchronous RL), under a staleness bound.

Step i trains batch i and makes weight version i + 1 (version 0: the weights the run starts
from). With `trainer.max_staleness` = s, batch j starts generating once the engines serve
version j - s, so while the actor trains batch i the engines generate batches i + 1 .. i + s.
A batch's oldest tokens are those of the version it started on, so no token is more than s
versions old when it is trained. s = 0 is the synchronous step: batch i starts once version i
is served, after the previous step's sync.

Without partial rollout a sync first waits for the batches in flight: each batch is generated
by one version, fixed by its index, so the run does not depend on timing, and a checkpoint
stores the batches ahead of it (the weights that generated them are gone) to resume exactly.
With partial rollout a sync lands while batches generate (the fleet pauses engine calls for
it); their later tokens come from the new weights and carry its version.
"""
from __future__ import annotations

import concurrent.futures
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from rlfactory_megatron.rollout.fleet import done
from rlfactory_megatron.rollout.prompts import PromptRecord
from rlfactory_megatron.rollout.rows import PendingRollout, Rollouts

if TYPE_CHECKING:
    from rlfactory_megatron.rollout.generator import RolloutGenerator

# The batches ahead of a checkpoint, with what the generating process made of them.
AHEAD_FILE = "rollouts_ahead.pkl"
# Where the pickled classes lived before the rollout side moved into rollout/: a checkpoint an
# earlier release wrote mid-run still resumes.
MOVED_MODULES = {"rlfactory_megatron.trainer.rollouts": "rlfactory_megatron.rollout.rows"}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        return super().find_class(MOVED_MODULES.get(module, module), name)


class RolloutPipeline:
    """Every rank holds one and calls it in the same order (`take`, `before_sync`, `after_sync`):
    batches start in index order, each drawing its prompts when it starts."""

    def __init__(self, generator: RolloutGenerator, draw: Callable[[], list[PromptRecord]], max_staleness: int,
                 partial_rollout: bool, total_steps: int) -> None:
        self.generator, self.draw = generator, draw
        self.max_staleness, self.partial_rollout, self.total_steps = max_staleness, partial_rollout, total_steps
        self.ahead: dict[int, PendingRollout] = {}  # started and not yet trained, by batch index
        self.next_batch = 0  # the first batch not started

    def take(self, step: int) -> Rollouts:
        """Batch `step` (the engines serve version `step`), once generated."""
        self.next_batch = max(self.next_batch, step)  # a run that starts at `step` (fresh or resumed)
        self._start_allowed(step)
        return self.generator.finish(self.ahead.pop(step))

    def before_sync(self) -> None:
        """Without partial rollout: wait until the batches in flight are generated."""
        if not self.partial_rollout:
            self._wait_for_ahead()

    def after_sync(self, version: int) -> None:
        """The engines serve `version`: start the batches it allows."""
        self.next_batch = max(self.next_batch, version)
        self._start_allowed(version)

    def _start_allowed(self, version: int) -> None:
        last = min(version + self.max_staleness, self.total_steps - 1)
        while self.next_batch <= last:
            self.ahead[self.next_batch] = self.generator.start(self.draw(), self.next_batch)
            self.next_batch += 1

    def _wait_for_ahead(self) -> None:
        concurrent.futures.wait([p.generation for p in self.ahead.values() if p.generation is not None])

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> bytes | None:
        """The batches ahead, generated (this waits for them), as checkpoint bytes; None on the
        ranks that did not generate them (they keep only the prompts, which rank 0 stores)."""
        self._wait_for_ahead()
        if self.generator.fleet.layout.rank != 0:
            return None
        return pickle.dumps({index: (p.records, p.generation.result() if p.generation is not None else None)
                             for index, p in sorted(self.ahead.items())}, protocol=pickle.HIGHEST_PROTOCOL)

    def restore(self, directory: Path) -> None:
        """The batches ahead of the checkpoint in `directory`, as they were generated."""
        path = directory / AHEAD_FILE
        if not path.is_file():
            return
        generating = self.generator.fleet.generates
        with open(path, "rb") as file:
            ahead = _Unpickler(file).load()
        for index, (records, generated) in ahead.items():
            self.ahead[index] = PendingRollout(records, index, False, 0,
                                               done(generated) if generating and generated is not None else None)
            self.next_batch = max(self.next_batch, index + 1)

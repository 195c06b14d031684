"""A colocated judge and the policy engine take turns on the generating process's devices: vLLM
budgets each engine's share against the device's free memory, so one share is awake at a time
(verl's and slime's order: the policy generates -> sleeps -> the judge wakes -> judges -> sleeps)."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Callable, TypeVar

from rlfactory_megatron.rollout.fleet import EngineFleet

Judge = TypeVar("Judge")


class JudgeTurns:
    """The hand-overs between this process's policy engine (`fleet`) and a colocated judge; with
    no judge or one on devices of its own (`colocated` false), nothing is handed over. The policy
    sleeps at level 1 for the judge: its weights wait in host memory, since it may generate again
    (a refill round, validation) before a weight sync would bring new ones."""

    def __init__(self, fleet: EngineFleet, colocated: bool) -> None:
        self.fleet, self.colocated = fleet, colocated

    def start(self, start_judge: Callable[[], Judge]) -> Judge:
        """The judge started (it sleeps once started: served_judge.start_judge) while the policy
        engine sleeps, then the policy engine awake again."""
        if not self.colocated:
            return start_judge()
        self.fleet.sleep(level=1)
        try:
            return start_judge()
        finally:
            self.fleet.wake_up()

    @contextlib.asynccontextmanager
    async def judging(self, judge):
        """The judge awake for the body, the policy engine asleep first; the judge asleep after."""
        if not self.colocated:
            yield
            return
        await asyncio.to_thread(self.fleet.sleep, 1)
        await judge.wake_up()
        try:
            yield
        finally:
            await judge.sleep()

    async def before_generation(self) -> None:
        """The policy engine awake to generate, if a judging phase left it asleep (it wakes only
        what is asleep: after a weight sync, nothing)."""
        if self.colocated:
            await asyncio.to_thread(self.fleet.wake_up)

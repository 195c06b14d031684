"""One request router in front of several engines, for the agent loop.

A trajectory's first turn goes to the engine with the least outstanding work (requests in
flight, then generated tokens so far), and every later turn of it to the same engine, whose
prefix cache holds the conversation. Where a request runs never changes what it generates:
a seeded sample depends on its prompt, weights and seed only. So when an engine fails (its
process died), its requests run again on the engines that remain and the step's trajectories
are the ones it would have had; the owner replaces the engine (`revive`) between steps.

Weight updates while trajectories are in flight (asynchronous RL) go through `pause()`: new
engine calls wait, the ones running finish, the owner syncs the weights and `resume(version)`s.
With `pause(interrupt=True)` (partial rollout) the running ones do not finish: the engines end
them between two decode steps, and each goes on after the resume as a new request whose prompt
holds the tokens it had (its KV is computed again, by the new weights: the tokens after the
update are exactly theirs). Every engine call runs on one weight version, which the trajectory's
session records for the tokens that call generated.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Callable

from rlfactory_megatron.envs.agent_loop import Completion, Front, merge_routes
from rlfactory_megatron.rollout.engines import SamplingConfig
from rlfactory_megatron.rollout.fronts import EngineStepError, GenerationInterrupted


def error_line(exc: BaseException) -> str:
    """An engine's error in one line: its type and the first line of its message."""
    message = str(exc).strip()
    return f"{type(exc).__name__}: {message.splitlines()[0] if message else ''}"


class EngineFailedError(RuntimeError):
    """No engine is left to serve requests."""


class EngineRouter:
    """Routes requests among engines through their fronts (`fronts[i]` serves engine i).
    `is_failure(exc)`: whether an error from an engine means the engine is gone (its requests
    go elsewhere) rather than a bad request (the caller sees it)."""

    def __init__(self, fronts: list[Front], is_failure: Callable[[BaseException], bool] = lambda exc: False):
        if not fronts:
            raise ValueError("a router needs at least one engine")
        self.fronts = fronts
        self.is_failure = is_failure
        self.outstanding = [0] * len(fronts)  # requests in flight per engine
        self.generated = [0] * len(fronts)  # tokens generated per engine (the tie-break)
        self.failed: dict[int, str] = {}  # engine -> why, until revived
        self.version = 0  # the weight version every engine serves (set by the owner after a sync)
        self._running = 0  # engine calls under way (not those waiting for a resume)
        self._open: asyncio.Event | None = None  # set: calls may start; created in the serving loop
        self._idle: asyncio.Event | None = None  # set: no call is under way
        self._events_loop = None
        self._interrupted: list[int] = []  # engines interrupted by the pause under way
        self._pauses = 0  # pauses begun: a call cut while none began says its engine is broken

    def session(self) -> "Session":
        """What one trajectory generates through: sticks to the engine of its first turn."""
        return Session(self)

    def least_loaded(self) -> int:
        alive = [i for i in range(len(self.fronts)) if i not in self.failed]
        if not alive:
            raise EngineFailedError("every rollout engine failed: " + "; ".join(
                f"engine {i}: {why}" for i, why in sorted(self.failed.items())))
        return min(alive, key=lambda i: (self.outstanding[i], self.generated[i], i))

    def fail(self, index: int, exc: BaseException) -> None:
        self.failed.setdefault(index, error_line(exc))

    def revive(self, index: int, front: Front) -> None:
        """`front`'s engine serves in place of failed engine `index` from now on."""
        self.fronts[index] = front
        self.failed.pop(index, None)

    def _events(self) -> tuple[asyncio.Event, asyncio.Event]:
        """The pause's events, made in the loop that serves (again if an earlier loop is gone)."""
        loop = asyncio.get_running_loop()
        if self._open is None or self._events_loop is not loop:
            self._open, self._idle, self._events_loop = asyncio.Event(), asyncio.Event(), loop
            self._open.set()
            self._idle.set()
        return self._open, self._idle

    async def pause(self, interrupt: bool = False) -> None:
        """Returns once no engine call is under way; calls made meanwhile wait for `resume`.
        `interrupt`: the engines that can end their requests between two decode steps do so now
        (a long turn does not hold the update back); the requests go on after `resume`."""
        opened, idle = self._events()
        opened.clear()
        self._pauses += 1
        if interrupt:
            self._interrupted = [i for i, front in enumerate(self.fronts)
                                 if i not in self.failed and callable(getattr(front, "interrupt", None))]
            # A dead engine's interrupt fails; its calls fail too and go to the other engines.
            await asyncio.gather(*(self.fronts[i].interrupt() for i in self._interrupted), return_exceptions=True)
        await idle.wait()

    async def resume(self, version: int) -> None:
        """Calls go on, on weights of `version`."""
        self.version = version
        interrupted, self._interrupted = self._interrupted, []
        released = await asyncio.gather(*(self.fronts[i].release() for i in interrupted), return_exceptions=True)
        for index, outcome in zip(interrupted, released):
            if isinstance(outcome, Exception) and index not in self.failed:
                self.fail(index, outcome)  # it would cut every later request: its requests go elsewhere
        self._events()[0].set()

    async def generate_on(self, index: int, prompt_token_ids: list[int],
                          sampling: SamplingConfig) -> tuple[Completion, list[tuple[int, int]]]:
        """(the tokens, their log-probs and the engine's routes; [(weight version, tokens)] of the
        engine calls that generated them: one, or more when weight updates interrupted the request,
        whose routes are then its continuation's, which computes every position again)."""
        opened, idle = self._events()
        ids, log_probs, spans, routes = [], [], [], None
        self.outstanding[index] += 1
        try:
            while True:
                while not opened.is_set():  # a weight update is under way
                    await opened.wait()
                if index in self.failed:  # it failed while this request waited (e.g. its release)
                    raise EngineStepError(f"engine {index} failed during a weight update: {self.failed[index]}")
                version, pauses = self.version, self._pauses
                self._running += 1
                idle.clear()
                interrupted = False
                try:
                    done = await self.fronts[index].generate(prompt_token_ids + ids, _continued(sampling, len(ids)))
                    routes = merge_routes(routes, getattr(done, "routes", None))
                    more, more_log_probs = done
                except GenerationInterrupted as cut:
                    if self._pauses == pauses:  # no weight update asked for it: the engine is stuck in one
                        raise EngineStepError(f"engine {index} cut a request with no weight update under way") from cut
                    more, more_log_probs, interrupted = cut.token_ids, cut.log_probs, True
                finally:
                    self._running -= 1
                    if self._running == 0:
                        idle.set()
                ids, log_probs = ids + more, log_probs + more_log_probs
                self.generated[index] += len(more)
                if more or not interrupted:
                    spans.append((version, len(more)))
                if not interrupted or len(ids) >= sampling.max_tokens:
                    return Completion(ids, log_probs, routes), spans
        finally:
            self.outstanding[index] -= 1


def _continued(sampling: SamplingConfig, generated: int) -> SamplingConfig:
    """The sampling of a request interrupted after `generated` tokens, for the rest: the tokens
    left, and a seed of its own (the original seed would draw the first tokens' numbers again)."""
    if not generated:
        return sampling
    seed = None if sampling.seed is None else (sampling.seed * 1_000_003 + generated) % 2**31
    return dataclasses.replace(sampling, max_tokens=sampling.max_tokens - generated, seed=seed)


class Session:
    """The engine interface of the agent loop (`await generate(prompt, sampling)`) for one trajectory."""

    def __init__(self, router: EngineRouter) -> None:
        self.router = router
        self.engine_index: int | None = None  # the engine this trajectory's turns go to
        self.calls: list[tuple[int, int, int]] = []  # (engine index, weight version, tokens) per engine call, in order

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingConfig) -> Completion:
        while True:
            if self.engine_index is None or self.engine_index in self.router.failed:
                # Chosen and counted before the first await: concurrent first turns spread out.
                self.engine_index = self.router.least_loaded()
            try:
                done, spans = await self.router.generate_on(self.engine_index, prompt_token_ids, sampling)
            except Exception as exc:
                if not self.router.is_failure(exc):
                    raise
                self.router.fail(self.engine_index, exc)  # and the request runs again on another engine
                continue
            self.calls += [(self.engine_index, version, tokens) for version, tokens in spans]
            return done

    def token_versions(self, generated: int) -> list[int]:
        """The weight version of each of the first `generated` tokens this session generated."""
        versions = [version for _, version, tokens in self.calls for _ in range(tokens)]
        return versions[:generated]

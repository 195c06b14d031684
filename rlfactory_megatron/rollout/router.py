"""One request router in front of several engines, for the agent loop.

A trajectory's first turn goes to the engine with the least outstanding work (requests in
flight, then generated tokens so far), and every later turn of it to the same engine, whose
prefix cache holds the conversation. Where a request runs never changes what it generates:
a seeded sample depends on its prompt, weights and seed only. So when an engine fails (its
process died), its requests run again on the engines that remain and the step's trajectories
are the ones it would have had; the owner replaces the engine (`revive`) between steps.

Weight updates while trajectories are in flight (asynchronous RL) go through `pause()`: new
engine calls wait, the ones running finish, the owner syncs the weights and `resume(version)`s.
Every call therefore runs on one weight version, which the trajectory's session records for the
tokens it generated.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable, Protocol


class AsyncEngine(Protocol):
    requests: int
    busy_s: float

    async def generate(self, prompt_token_ids: list[int], sampling: dict[str, Any]) -> tuple[list[int], list[float]]: ...


def error_line(exc: BaseException) -> str:
    """An engine's error in one line: its type and the first line of its message."""
    message = str(exc).strip()
    return f"{type(exc).__name__}: {message.splitlines()[0] if message else ''}"


class EngineFailedError(RuntimeError):
    """No engine is left to serve requests."""


class EngineRouter:
    """`is_failure(exc)`: whether an error from an engine means the engine is gone (its requests
    go elsewhere) rather than a bad request (the caller sees it)."""

    def __init__(self, engines: list[AsyncEngine], is_failure: Callable[[BaseException], bool] = lambda exc: False):
        if not engines:
            raise ValueError("a router needs at least one engine")
        self.engines = engines
        self.is_failure = is_failure
        self.outstanding = [0] * len(engines)  # requests in flight per engine
        self.generated = [0] * len(engines)  # tokens generated per engine (the tie-break)
        self.failed: dict[int, str] = {}  # engine -> why, until revived
        self.version = 0  # the weight version every engine serves (set by the owner after a sync)
        self._running = 0  # engine calls under way (not those waiting for a resume)
        self._open: asyncio.Event | None = None  # set: calls may start; created in the serving loop
        self._idle: asyncio.Event | None = None  # set: no call is under way
        self._events_loop = None

    def session(self) -> "Session":
        """What one trajectory generates through: sticks to the engine of its first turn."""
        return Session(self)

    def least_loaded(self) -> int:
        alive = [i for i in range(len(self.engines)) if i not in self.failed]
        if not alive:
            raise EngineFailedError("every rollout engine failed: " + "; ".join(
                f"engine {i}: {why}" for i, why in sorted(self.failed.items())))
        return min(alive, key=lambda i: (self.outstanding[i], self.generated[i], i))

    def fail(self, index: int, exc: BaseException) -> None:
        self.failed.setdefault(index, error_line(exc))

    def revive(self, index: int, engine: AsyncEngine) -> None:
        """`engine` serves in place of failed engine `index` from now on."""
        self.engines[index] = engine
        self.failed.pop(index, None)
        self.outstanding[index] = 0

    def _events(self) -> tuple[asyncio.Event, asyncio.Event]:
        """The pause's events, made in the loop that serves (again if an earlier loop is gone)."""
        loop = asyncio.get_running_loop()
        if self._open is None or self._events_loop is not loop:
            self._open, self._idle, self._events_loop = asyncio.Event(), asyncio.Event(), loop
            self._open.set()
            self._idle.set()
        return self._open, self._idle

    async def pause(self) -> None:
        """Returns once no engine call is under way; calls made meanwhile wait for `resume`."""
        opened, idle = self._events()
        opened.clear()
        await idle.wait()

    async def resume(self, version: int) -> None:
        """Calls go on, on weights of `version`."""
        self.version = version
        self._events()[0].set()

    async def generate_on(self, index: int, prompt_token_ids: list[int],
                          sampling: dict[str, Any]) -> tuple[list[int], list[float], int]:
        """(token ids, log-probs, the weight version that generated them)."""
        opened, idle = self._events()
        self.outstanding[index] += 1
        try:
            while not opened.is_set():  # a weight update is under way
                await opened.wait()
            version = self.version
            self._running += 1
            idle.clear()
            try:
                ids, log_probs = await self.engines[index].generate(prompt_token_ids, sampling)
            finally:
                self._running -= 1
                if self._running == 0:
                    idle.set()
        finally:
            self.outstanding[index] -= 1
        self.generated[index] += len(ids)
        return ids, log_probs, version


class Session:
    """The engine interface of the agent loop (`await generate(prompt, sampling)`) for one trajectory."""

    def __init__(self, router: EngineRouter) -> None:
        self.router = router
        self.engine: int | None = None
        self.calls: list[tuple[int, int, int]] = []  # (engine, weight version, tokens) per call, in order

    async def generate(self, prompt_token_ids: list[int], sampling: dict[str, Any]) -> tuple[list[int], list[float]]:
        while True:
            if self.engine is None or self.engine in self.router.failed:
                # Chosen and counted before the first await: concurrent first turns spread out.
                self.engine = self.router.least_loaded()
            try:
                ids, log_probs, version = await self.router.generate_on(self.engine, prompt_token_ids, sampling)
            except Exception as exc:
                if not self.router.is_failure(exc):
                    raise
                self.router.fail(self.engine, exc)  # and the request runs again on another engine
                continue
            self.calls.append((self.engine, version, len(ids)))
            return ids, log_probs

    def token_versions(self, generated: int) -> list[int]:
        """The weight version of each of the first `generated` tokens this session generated."""
        versions = [version for _, version, tokens in self.calls for _ in range(tokens)]
        return versions[:generated]

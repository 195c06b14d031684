"""One request router in front of several engines, for the agent loop.

A trajectory's first turn goes to the engine with the least outstanding work (requests in
flight, then generated tokens so far), and every later turn of it to the same engine, whose
prefix cache holds the conversation. Where a request runs never changes what it generates:
a seeded sample depends on its prompt, weights and seed only.
"""
from __future__ import annotations

from typing import Any, Protocol


class AsyncEngine(Protocol):
    requests: int
    busy_s: float

    async def generate(self, prompt_token_ids: list[int], sampling: dict[str, Any]) -> tuple[list[int], list[float]]: ...


class EngineRouter:
    def __init__(self, engines: list[AsyncEngine]) -> None:
        if not engines:
            raise ValueError("a router needs at least one engine")
        self.engines = engines
        self.outstanding = [0] * len(engines)  # requests in flight per engine
        self.generated = [0] * len(engines)  # tokens generated per engine (the tie-break)

    def session(self) -> "Session":
        """What one trajectory generates through: sticks to the engine of its first turn."""
        return Session(self)

    def least_loaded(self) -> int:
        return min(range(len(self.engines)), key=lambda i: (self.outstanding[i], self.generated[i], i))

    async def generate_on(self, index: int, prompt_token_ids: list[int],
                          sampling: dict[str, Any]) -> tuple[list[int], list[float]]:
        self.outstanding[index] += 1
        try:
            ids, log_probs = await self.engines[index].generate(prompt_token_ids, sampling)
        finally:
            self.outstanding[index] -= 1
        self.generated[index] += len(ids)
        return ids, log_probs


class Session:
    """The engine interface of the agent loop (`await generate(prompt, sampling)`) for one trajectory."""

    def __init__(self, router: EngineRouter) -> None:
        self.router = router
        self.engine: int | None = None

    async def generate(self, prompt_token_ids: list[int], sampling: dict[str, Any]) -> tuple[list[int], list[float]]:
        if self.engine is None:  # chosen and counted before the first await: concurrent firsts spread
            self.engine = self.router.least_loaded()
        return await self.router.generate_on(self.engine, prompt_token_ids, sampling)

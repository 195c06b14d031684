"""Per-request asyncio generation over a batched rollout engine: concurrent agent-loop coroutines
are gathered for a short window (or until `max_batch` wait) and served by one batched call."""
from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from rlfactory_megatron.rollout.engines import RolloutEngine, SamplingConfig

_SAMPLING_KEYS = frozenset(f.name for f in dataclasses.fields(SamplingConfig))


def sampling_config(sampling: dict[str, Any]) -> SamplingConfig:
    """The agent loop's sampling dict as a SamplingConfig; unknown keys and `n != 1` are errors."""
    unknown = set(sampling) - _SAMPLING_KEYS
    if unknown:
        raise ValueError(f"sampling: unknown keys {sorted(unknown)}; valid: {sorted(_SAMPLING_KEYS)}")
    if sampling.get("n", 1) != 1:
        raise ValueError(f"sampling.n={sampling['n']}: the agent loop runs one coroutine per sample, so n must be 1")
    values = dict(sampling)
    for key in ("stop", "stop_token_ids"):
        if key in values:
            values[key] = tuple(values[key] or ())
    return SamplingConfig(**values)


@dataclass
class _Request:
    prompt: list[int]
    sampling: SamplingConfig
    done: asyncio.Future


class AsyncBatchingEngine:
    """`await generate(prompt_token_ids, sampling_dict) -> (token_ids, log_probs)` on top of a
    synchronous batched `engine.generate(prompts, SamplingConfig)`.

    The first waiting request opens a window of `window_s`; everything that arrives before it
    closes (or until `max_batch` requests wait) runs as one engine call in a worker thread, so the
    event loop keeps running tools meanwhile. One batched call runs at a time: the engine is not
    thread-safe, and requests that arrive while it runs form the next batch. Requests whose
    sampling differs only in `max_tokens` or `seed` share a call at the largest cap, each with its
    own seed, and are cut to their own cap (a shorter run yields the same prefix); other
    differences split the batch.
    """

    def __init__(self, engine: RolloutEngine, max_batch: int = 256, window_s: float = 0.01):
        self.engine = engine
        self.max_batch = max_batch
        self.window_s = window_s
        self.batches = 0  # engine calls made
        self.requests = 0  # requests they served
        self.busy_s = 0.0  # wall time inside engine calls
        self._pending: list[_Request] = []
        self._arrived: asyncio.Event | None = None
        self._full: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None

    async def generate(self, prompt_token_ids: list[int], sampling: dict[str, Any]) -> tuple[list[int], list[float]]:
        config = sampling_config(sampling)  # bad keys fail in the caller, not in the batch
        if self._worker is None or self._worker.done():
            # First call, or the previous event loop is gone (and with it its waiting callers).
            self._pending = []
            self._arrived, self._full = asyncio.Event(), asyncio.Event()
            self._worker = asyncio.create_task(self._serve())
        request = _Request(list(prompt_token_ids), config, asyncio.get_running_loop().create_future())
        self._pending.append(request)
        self._arrived.set()
        if len(self._pending) >= self.max_batch:
            self._full.set()
        return await request.done

    async def close(self) -> None:
        """Stop the batching task (the wrapped engine stays open; its owner closes it)."""
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker = None
        for request in self._pending:
            request.done.cancel()
        self._pending = []

    async def _serve(self) -> None:
        while True:
            await self._arrived.wait()
            try:
                await asyncio.wait_for(self._full.wait(), self.window_s)
            except asyncio.TimeoutError:
                pass
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch:]
            if not self._pending:
                self._arrived.clear()
            if len(self._pending) < self.max_batch:
                self._full.clear()
            for group in _group_by_sampling(batch):
                await self._run(group)

    async def _run(self, group: list[_Request]) -> None:
        sampling = dataclasses.replace(group[0].sampling, max_tokens=max(r.sampling.max_tokens for r in group))
        try:
            seeds = [r.sampling.seed for r in group] if any(r.sampling.seed is not None for r in group) else None
            started = time.perf_counter()
            try:
                outputs = await asyncio.to_thread(self.engine.generate, [r.prompt for r in group], sampling, seeds)
            finally:
                self.busy_s += time.perf_counter() - started
        except Exception as exc:  # every caller of the batch sees the engine's failure
            for request in group:
                if not request.done.done():
                    request.done.set_exception(exc)
            return
        self.batches += 1
        self.requests += len(group)
        for request, samples in zip(group, outputs):
            cap = request.sampling.max_tokens
            if not request.done.done():  # its caller may have been cancelled meanwhile
                request.done.set_result((list(samples[0].token_ids[:cap]), list(samples[0].log_probs[:cap])))


def _group_by_sampling(batch: list[_Request]) -> list[list[_Request]]:
    groups: dict[SamplingConfig, list[_Request]] = {}
    for request in batch:
        groups.setdefault(dataclasses.replace(request.sampling, max_tokens=0, seed=None), []).append(request)
    return list(groups.values())

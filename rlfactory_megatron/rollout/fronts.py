"""Per-request asyncio generation (`await generate(prompt, sampling)`) over a rollout engine.

`StreamingFront` serves an engine that steps (vLLM's in-process engine): a request joins the
running batch at the next engine step and its caller resumes the moment it finishes, so one
trajectory's tool call overlaps the others' decoding. `RemoteFront` does the same for
an engine that streams on its own side (a Ray-hosted one, whose actor runs a StreamingFront):
requests gathered in a short window go in one remote call, and each result comes back as its
request finishes. `BatchingFront` serves an engine that only takes whole batches: a call
lasts as long as its longest request. `serving(engine)` picks the one the engine allows.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import time
from dataclasses import dataclass

from rlfactory_megatron.envs.agent_loop import Completion
from rlfactory_megatron.rollout.engines import RolloutEngine, SamplingConfig


class GenerationInterrupted(Exception):
    """A request ended between two engine steps so that new weights can come in (partial rollout),
    with the tokens and log-probs it had generated; the router continues it on the new weights."""

    def __init__(self, token_ids: list[int], log_probs: list[float]) -> None:
        super().__init__(token_ids, log_probs)  # the arguments again: it crosses processes pickled
        self.token_ids, self.log_probs = list(token_ids), list(log_probs)

    def __str__(self) -> str:
        return f"interrupted for a weight update after {len(self.token_ids)} tokens"


class EngineStepError(RuntimeError):
    """The engine failed a step: the requests it ran are lost, and its state is unknown (vLLM's
    own engine is dead after one). The front serves no further request; the router counts the
    engine as failed (its requests run again elsewhere) and its owner replaces it."""


def _one_sample(sampling: SamplingConfig) -> SamplingConfig:
    """A front's request: one continuation (checked in the caller, not in the batch)."""
    if sampling.n != 1:
        raise ValueError(f"sampling.n={sampling.n}: the agent loop runs one coroutine per sample, so n must be 1")
    return sampling


def serving(engine, window_s: float = 0.01):
    """The asyncio front of `engine`: streaming where the engine can step or streams itself, batched otherwise."""
    if all(callable(getattr(engine, name, None)) for name in ("submit", "step", "abort")):
        return StreamingFront(engine, window_s=window_s)
    if callable(getattr(engine, "stream", None)):
        return RemoteFront(engine, window_s=window_s)
    return BatchingFront(engine, window_s=window_s)


@dataclass
class _Request:
    prompt: list[int]
    sampling: SamplingConfig
    done: asyncio.Future


class BatchingFront:
    """`await generate(prompt_token_ids, sampling) -> Completion` (`(token_ids, log_probs)`) on top of a
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

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingConfig) -> Completion:
        config = _one_sample(sampling)
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
        self._worker = await _cancelled(self._worker)
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
                sample, fed = samples[0], len(request.prompt) + cap - 1  # positions of the capped sequence but its last
                request.done.set_result(Completion(sample.token_ids[:cap], sample.log_probs[:cap],
                                                   None if sample.routes is None else sample.routes[:fed]))


async def _cancelled(task: asyncio.Task | None) -> None:
    """Cancels a serving task and waits for it to end (None: the slot it leaves)."""
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _group_by_sampling(batch: list[_Request]) -> list[list[_Request]]:
    groups: dict[SamplingConfig, list[_Request]] = {}
    for request in batch:
        groups.setdefault(dataclasses.replace(request.sampling, max_tokens=0, seed=None), []).append(request)
    return list(groups.values())


class StreamingFront:
    """`await generate(prompt_token_ids, sampling) -> Completion` (`(token_ids, log_probs)`) on an engine that
    takes requests one by one (`submit`) and runs them in steps (`step` -> the finished ones).

    One task steps the engine in a worker thread while any request runs (the event loop keeps
    running tools meanwhile); requests that arrive during a step join at the next one, and each
    caller resumes when its own request finishes, not when a batch does. An idle engine waits
    `window_s` after the first arrival, so that a batch's first turns start in one step. A caller
    cancelled meanwhile has its request aborted in the engine. `interrupt()` ends every request
    after the step under way (a weight update comes in between two decode steps) until `release()`.
    """

    def __init__(self, engine, window_s: float = 0.01):
        self.engine = engine
        self.window_s = window_s
        self.steps = 0  # engine steps made
        self.requests = 0  # requests finished
        self.busy_s = 0.0  # wall time with at least one request in the engine
        self._ids = (f"rlf-{n}" for n in itertools.count())
        self._arrivals: list[tuple[str, _Request]] = []  # submitted at the next step
        self._running: dict[str, _Request] = {}  # in the engine
        self._orphans: list[str] = []  # in the engine, their callers' event loop gone: aborted next step
        self._arrived: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._step: asyncio.Future | None = None  # the engine step under way, if any
        # A thread of its own: the loop's default executor also runs tools' blocking calls.
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._stopping = False  # set by close: the step thread returns after its current step
        self.failure: EngineStepError | None = None  # set by a failed step, for good
        self._held = False  # between interrupt() and release(): no request runs
        self._interrupting: list[asyncio.Future] = []  # interrupt() calls waiting for the engine to empty

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingConfig) -> Completion:
        config = _one_sample(sampling)
        if self.failure is not None:
            raise self.failure
        if self._held:
            raise GenerationInterrupted([], [])
        if self._worker is None or self._worker.done():
            # First call, or the previous event loop is gone (and with it its waiting callers).
            self._orphans += list(self._running)
            self._arrivals, self._running = [], {}
            self._arrived = asyncio.Event()
            self._worker = asyncio.create_task(self._serve())
        request = _Request(list(prompt_token_ids), config, asyncio.get_running_loop().create_future())
        self._arrivals.append((next(self._ids), request))
        self._arrived.set()
        return await request.done

    async def interrupt(self) -> None:
        """Ends every request in the engine after the step under way: its caller gets
        GenerationInterrupted with the tokens it generated, and so does every request made until
        `release()`. Returns once the engine runs no request (new weights may then be loaded)."""
        self._held = True
        if self.failure is not None or self._worker is None or self._worker.done():
            return
        if not (self._running or self._arrivals or self._step is not None):
            return
        emptied = asyncio.get_running_loop().create_future()
        self._interrupting.append(emptied)
        self._arrived.set()  # an idle serving task wakes up to answer
        await emptied

    async def release(self) -> None:
        """Requests run again (after `interrupt`)."""
        self._held = False

    async def close(self) -> None:
        """Stop stepping (the wrapped engine stays open; its owner closes it); waiting callers are cancelled."""
        self._stopping = True
        self._worker = await _cancelled(self._worker)
        if self._step is not None:  # a step in its thread cannot be cancelled: let it end first
            await asyncio.gather(self._step, return_exceptions=True)
            self._step = None
        stale = list(self._running) + self._orphans
        if stale and self.failure is None:  # a failed engine is replaced, not cleaned
            await asyncio.to_thread(self.engine.abort, stale)
        if self._thread is not None:
            self._thread.shutdown(wait=False)
            self._thread = None
        for request in [r for _, r in self._arrivals] + list(self._running.values()):
            request.done.cancel()
        self._arrivals, self._running, self._orphans = [], {}, []
        self._stopping = False
        self._emptied()

    def _emptied(self) -> None:
        """The engine runs nothing: the interrupt() calls waiting for that return."""
        for emptied in self._interrupting:
            if not emptied.done():
                emptied.set_result(None)
        self._interrupting = []

    def _failed(self, exc: Exception, running: dict[str, _Request], arrivals: list[tuple[str, _Request]]) -> None:
        """The engine failed (a step or an interrupt): every caller sees it, and so does every later one."""
        self.failure = EngineStepError(f"the engine failed a step: {type(exc).__name__}: {str(exc).strip()[:300]}")
        self.failure.__cause__ = exc
        for request in [*running.values(), *(r for _, r in arrivals)]:
            if not request.done.done():
                request.done.set_exception(self.failure)
        self._orphans, self._running, self._arrivals = list(running), {}, []
        self._emptied()

    async def _interrupt_all(self, loop) -> bool:
        """Ends the requests in the engine (and those about to join it) with what each generated;
        False if the engine failed meanwhile."""
        arrivals, running, orphans = self._arrivals, self._running, self._orphans
        self._arrivals, self._running, self._orphans = [], {}, []
        partial = {}
        if running or orphans:
            self._step = loop.run_in_executor(self._step_thread(), self.engine.interrupt, [*running, *orphans])
            try:
                partial = await asyncio.shield(self._step)
            except asyncio.CancelledError:  # closing: its callers are cancelled with it
                for request in [*running.values(), *(r for _, r in arrivals)]:
                    request.done.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 - as a failed step
                self._failed(exc, running, arrivals)
                return False
            finally:
                if self._step is not None and self._step.done():
                    self._step = None
        for rid, request in [*running.items(), *arrivals]:
            generation = partial.get(rid)
            if not request.done.done():  # its caller may have been cancelled meanwhile
                request.done.set_exception(GenerationInterrupted(generation.token_ids if generation else [],
                                                                 generation.log_probs if generation else []))
        self._emptied()
        return True

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._held and not await self._interrupt_all(loop):
                return
            if not self._running:
                self._arrived.clear()
                if not self._arrivals:
                    await self._arrived.wait()
                if not self._held:
                    await asyncio.sleep(self.window_s)
                if self._held:  # an interrupt came meanwhile
                    continue
            arrivals, self._arrivals = self._arrivals, []
            cancelled = [rid for rid, request in self._running.items() if request.done.cancelled()]
            aborted, self._orphans = cancelled + self._orphans, []
            for rid in cancelled:
                del self._running[rid]
            already_running = len(self._running)
            self._running.update(arrivals)
            started = time.perf_counter()
            self._step = loop.run_in_executor(self._step_thread(), self._advance, arrivals, aborted, already_running)
            try:
                refused, finished, steps = await asyncio.shield(self._step)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - every caller, running or waiting, sees the engine's failure
                self._failed(exc, self._running, self._arrivals)
                return
            finally:
                self.busy_s += time.perf_counter() - started
            self._step = None
            self.steps += steps
            for rid, exc in refused:  # a request the engine would not take fails alone
                request = self._running.pop(rid)
                if not request.done.done():
                    request.done.set_exception(exc)
            for rid, generation in finished:
                request = self._running.pop(rid, None)
                if request is None:
                    continue
                self.requests += 1
                if not request.done.done():  # its caller may have been cancelled meanwhile
                    request.done.set_result(Completion(generation.token_ids, generation.log_probs, generation.routes))

    def _step_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlf-engine-step")
        return self._thread

    def _advance(self, arrivals: list[tuple[str, _Request]], aborted: list[str], already_running: int):
        """In the step thread, the engine's only caller while it runs: (refused, finished, steps).

        Steps on until a request finishes or a new one arrives: one hop to the event loop per
        change to the batch, not per forward pass."""
        if aborted:
            self.engine.abort(aborted)
        refused = []
        for rid, request in arrivals:
            try:
                self.engine.submit(rid, request.prompt, request.sampling)
            except Exception as exc:  # noqa: BLE001 - e.g. a prompt over the engine's length: its caller's error
                refused.append((rid, exc))
        if already_running + len(arrivals) == len(refused):
            # Nothing left to run (only aborts, or every arrival refused): an engine whose core is
            # another process would wait in `step` for outputs that never come.
            return refused, [], 0
        steps = 0
        while True:
            finished = self.engine.step()
            steps += 1
            if finished or self._arrivals or self._stopping or self._held:  # read across threads: a stale answer costs a step
                return refused, finished, steps


class RemoteFront:
    """`await generate(prompt_token_ids, sampling) -> Completion` (`(token_ids, log_probs)`) on an engine that
    streams on its own side: `engine.stream(prompts, samplings)` is an async iterator of
    `(index, result)` in the order the requests finish, `result` being `(token_ids, log_probs)` or
    the exception that request raised (a Ray-hosted engine: one actor call per batch, one streamed
    return per request).

    Requests gathered in a window of `window_s` form one call; calls do not wait for each other
    (the engine's own StreamingFront merges them into its running batch), so a trajectory's next
    turn starts while other calls still decode. An error of the call itself (the engine's process
    died) reaches every caller of the call that has no result yet. A caller cancelled meanwhile
    does not stop its request (the engine finishes it); closing cancels the calls under way.
    `interrupt()`/`release()` go to the engine's own front (see StreamingFront).
    """

    def __init__(self, engine, window_s: float = 0.01):
        self.engine = engine
        self.window_s = window_s
        self.calls = 0  # remote calls made
        self.requests = 0  # requests finished
        self.busy_s = 0.0  # wall time with at least one request in the engine
        self._pending: list[_Request] = []
        self._arrived: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._calls: set[asyncio.Task] = set()
        self._in_flight = 0
        self._busy_since = 0.0
        self._held = False  # between interrupt() and release()

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingConfig) -> Completion:
        config = _one_sample(sampling)
        if self._held:
            raise GenerationInterrupted([], [])
        if self._worker is None or self._worker.done():
            # First call, or the previous event loop is gone (and with it its calls and callers).
            self._pending, self._calls, self._in_flight = [], set(), 0
            self._arrived = asyncio.Event()
            self._worker = asyncio.create_task(self._serve())
        request = _Request(list(prompt_token_ids), config, asyncio.get_running_loop().create_future())
        self._pending.append(request)
        self._arrived.set()
        return await request.done

    async def interrupt(self) -> None:
        """Requests not yet sent end here with no tokens; the engine's side ends those it runs
        after its current step (their callers get what each generated). Returns once it has."""
        self._held = True
        pending, self._pending = self._pending, []
        for request in pending:
            if not request.done.done():
                request.done.set_exception(GenerationInterrupted([], []))
        await self.engine.interrupt()

    async def release(self) -> None:
        self._held = False
        await self.engine.release()

    async def close(self) -> None:
        """Stop calling (the engine stays open; its owner closes it); waiting callers are cancelled."""
        self._worker = await _cancelled(self._worker)
        for call in list(self._calls):
            await _cancelled(call)
        for request in self._pending:
            request.done.cancel()
        self._pending, self._calls = [], set()

    async def _serve(self) -> None:
        while True:
            await self._arrived.wait()
            await asyncio.sleep(self.window_s)
            batch, self._pending = self._pending, []
            self._arrived.clear()
            if not batch:  # an interrupt ended them meanwhile
                continue
            call = asyncio.create_task(self._call(batch))
            self._calls.add(call)
            call.add_done_callback(self._calls.discard)

    async def _call(self, batch: list[_Request]) -> None:
        self.calls += 1
        self._entered(len(batch))
        left = dict(enumerate(batch))
        try:
            async for index, result in self.engine.stream([r.prompt for r in batch],
                                                          [r.sampling for r in batch]):
                request = left.pop(index)
                self._left(1)
                if request.done.done():  # its caller was cancelled meanwhile
                    continue
                if isinstance(result, BaseException):
                    request.done.set_exception(result)
                else:
                    self.requests += 1
                    request.done.set_result(Completion(*result, routes=getattr(result, "routes", None)))
            if left:
                raise RuntimeError(f"the engine's stream ended without the results of {len(left)} requests")
        except asyncio.CancelledError:  # closing: its callers are cancelled with it
            for request in left.values():
                request.done.cancel()
            raise
        except Exception as exc:  # the call failed: every request without a result sees why
            for request in left.values():
                if not request.done.done():
                    request.done.set_exception(exc)
        finally:
            self._left(len(left))

    def _entered(self, count: int) -> None:
        if self._in_flight == 0:
            self._busy_since = time.perf_counter()
        self._in_flight += count

    def _left(self, count: int) -> None:
        if count and self._in_flight:
            self._in_flight -= count
            if self._in_flight == 0:
                self.busy_s += time.perf_counter() - self._busy_since

"""Ray tool pool: tools run in CPU Ray actors behind a bounded queue, with per-call timeouts,
one re-run after an actor death, per-tool metrics (calls, errors, timeouts, latency percentiles,
cache hits/misses), and results of cacheable tools answered from / stored in the artifact cache."""
from __future__ import annotations

import asyncio
import functools
import itertools
import os
import time
import uuid
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray

from rlfactory_megatron.envs.tools import ToolBox, ToolResult, ToolSpec, load_tool_specs, parse_tool_specs

if TYPE_CHECKING:  # tool actors import this module; they need no HDF5
    from rlfactory_megatron.envs.storage import ToolArtifactCache

_LATENCY_WINDOW = 100_000
# Extra wait on the driver beyond the per-call timeout the actor enforces, for Ray transport delays.
_DRIVER_SLACK_S = 2.0
_SUBMIT_RETRIES = 3
_RESTART_POLL_S = 0.1
# Calls submitted together finish spread over about the time it took to start them. Once one has
# finished, a result poll waits for the others of its submit, so that one message carries them all
# rather than a trickle of small ones, but for no more than this share of the call's own run time
# (a fast tool waits for nothing) and no more than the cap.
_STRAGGLER_SHARE = 0.05
_STRAGGLER_WAIT_MAX_S = 0.005


def ensure_ray(num_cpus: int | None = None) -> None:
    """Join the cluster at RAY_ADDRESS if set, else start a local Ray (call from the leading rank)."""
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    # "local" so a stray cluster from `ray start` on this host is not silently joined.
    ray.init(address=address or "local", num_cpus=None if address else num_cpus, include_dashboard=False)


@dataclass
class ToolPoolConfig:
    tools: list[ToolSpec]
    num_actors: int = 2
    num_cpus_per_actor: float = 1.0
    max_concurrency: int = 64  # calls in flight per actor (async actor); tools must not block its event loop
    call_timeout_s: float = 30.0
    max_queue: int = 1024  # calls waiting for a free slot before callers block (backpressure)
    use_cache: bool = True  # answer cacheable tools from the artifact cache given to the pool, if any

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "ToolPoolConfig":
        """`tools` is a list of `{class, params}` entries or the path of a YAML file holding one."""
        config = dict(config)
        tools = config.pop("tools", [])
        specs = load_tool_specs(tools) if isinstance(tools, str) else parse_tool_specs(tools)
        unknown = set(config) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"tool_pool: unknown keys {sorted(unknown)}; valid: {sorted(cls.__dataclass_fields__)}")
        return cls(tools=specs, **config)


@dataclass(eq=False)
class _Submitted:
    """Calls an actor started together: they share a deadline, and their results travel together."""

    timer: asyncio.TimerHandle
    started: float
    unfinished: int
    any_finished: bool = False


class ToolActor:
    """Holds one ToolBox in a Ray worker. `submit` starts calls and returns at once;
    `next_results` hands back everything finished since the last poll, so under load one Ray
    message carries many calls. Tools are built lazily, so a restarted actor rebuilds them."""

    def __init__(self, specs: list[ToolSpec]):
        self._specs = specs
        self._box: ToolBox | None = None
        self._lock = asyncio.Lock()
        # (call id, text, metadata, is_error): plain tuples pickle ~20x faster than ToolResults.
        self._finished: list[tuple[int, str, dict[str, Any], bool]] = []
        self._stragglers = 0  # unfinished calls of submits some of whose calls have finished
        self._straggler_wait_s = 0.0
        self._poll: asyncio.Future | None = None  # the waiting `next_results`, woken by `_done`
        self._poll_wants_stragglers = False
        self._polls = 0  # `next_results` calls so far: only the latest one takes results
        # Tells the driver which incarnation accepted a call, to know what a crash lost.
        self.incarnation = uuid.uuid4().hex

    async def _toolbox(self) -> ToolBox:
        async with self._lock:
            if self._box is None:
                self._box = await ToolBox.build(self._specs)
        return self._box

    async def schemas(self) -> list[dict[str, Any]]:
        return (await self._toolbox()).schemas()

    async def cacheable_tools(self) -> list[str]:
        return (await self._toolbox()).cacheable_tools()

    async def pid(self) -> int:
        return os.getpid()

    async def submit(self, batch: list[tuple[int, str, dict[str, Any]]], timeout_s: float) -> str:
        box = await self._toolbox()
        tasks = [asyncio.ensure_future(box.run(name, args)) for _, name, args in batch]
        loop = asyncio.get_running_loop()
        # One timer per batch, not per call: its calls started together and share the deadline.
        submitted = _Submitted(loop.call_later(timeout_s, _cancel_all, tasks), loop.time(), len(tasks))
        for (rid, name, _), task in zip(batch, tasks):
            task.add_done_callback(functools.partial(self._done, rid, name, timeout_s, submitted))
        return self.incarnation

    def _done(self, rid: int, name: str, timeout_s: float, submitted: _Submitted, task: asyncio.Task) -> None:
        submitted.unfinished -= 1
        if not submitted.unfinished:
            submitted.timer.cancel()
        if submitted.any_finished:
            self._stragglers -= 1
        else:
            submitted.any_finished = True
            self._stragglers += submitted.unfinished
            age = asyncio.get_running_loop().time() - submitted.started
            self._straggler_wait_s = min(_STRAGGLER_WAIT_MAX_S, _STRAGGLER_SHARE * age)
        if task.cancelled():
            self._finished.append((rid, f"tool '{name}' timed out after {timeout_s:g}s", {"error_kind": "timeout"}, True))
        elif task.exception() is not None:
            exc = task.exception()
            text = f"tool '{name}' failed: {type(exc).__name__}: {exc}"
            self._finished.append((rid, text, {"error_kind": "exception"}, True))
        else:
            result = task.result()
            self._finished.append((rid, result.text, result.metadata, result.is_error))
        poll = self._poll
        if poll is not None and not poll.done() and not (self._poll_wants_stragglers and self._stragglers):
            poll.set_result(None)

    async def next_results(self, seen: str | None) -> tuple[str, list[tuple[int, str, dict[str, Any], bool]]]:
        """Waits for at least one finished call (and briefly for the calls submitted with it), then
        returns all finished ones as (call id, text, metadata, is_error), with this incarnation's
        id. A driver that has not `seen` this incarnation gets the id at once, so it learns of a
        restart (and re-runs what died) without waiting for a result."""
        if seen != self.incarnation:
            return self.incarnation, []
        # A driver that gave up on a poll (e.g. Ray reported the actor unavailable for a moment)
        # sends a new one; the old one then returns empty, as nobody reads its answer.
        self._polls += 1
        poll = self._polls
        if self._poll is not None and not self._poll.done():
            self._poll.set_result(None)
        if not self._finished:
            await self._wait(stragglers=False, timeout_s=None)
        if poll == self._polls and self._stragglers and self._straggler_wait_s > 0:
            await self._wait(stragglers=True, timeout_s=self._straggler_wait_s)
        if poll != self._polls:
            return self.incarnation, []
        ready, self._finished = self._finished, []
        return self.incarnation, ready

    async def _wait(self, stragglers: bool, timeout_s: float | None) -> None:
        """Until a call finishes or, with `stragglers`, until no straggler is left (or `timeout_s`)."""
        waiter = self._poll = asyncio.get_running_loop().create_future()
        self._poll_wants_stragglers = stragglers
        try:
            await asyncio.wait([waiter], timeout=timeout_s)
        finally:
            if self._poll is waiter:
                self._poll = None


def _cancel_all(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()


@dataclass
class ToolMetrics:
    """`calls` (and errors, timeouts, latencies) count executions in the actors; a cache hit is
    answered without one and counts only in `cache_hits`. `cache_misses`: lookups that executed."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    actor_deaths: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    latencies_s: deque = field(default_factory=lambda: deque(maxlen=_LATENCY_WINDOW))

    def record(self, result: ToolResult, latency_s: float) -> None:
        self.calls += 1
        self.errors += int(result.is_error)
        self.timeouts += int(result.metadata.get("error_kind") == "timeout")
        self.latencies_s.append(latency_s)

    def summary(self) -> dict[str, float]:
        ordered = sorted(self.latencies_s)

        def pct(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0

        return {
            "calls": self.calls, "errors": self.errors, "timeouts": self.timeouts, "actor_deaths": self.actor_deaths,
            "cache_hits": self.cache_hits, "cache_misses": self.cache_misses,
            "latency_p50_s": pct(0.50), "latency_p90_s": pct(0.90), "latency_p99_s": pct(0.99),
        }


@dataclass
class _Request:
    rid: int
    name: str
    args: dict[str, Any]
    done: asyncio.Future
    started: float = 0.0
    incarnation: str | None = None  # set once an actor incarnation has accepted the call
    reruns: int = 0


@dataclass
class _ActorLane:
    """Driver-side state of one actor: its free call slots and the calls it holds."""

    actor: Any
    free: int  # call slots not held by a pending call
    pending: dict[int, _Request] = field(default_factory=dict)
    sending: int = 0  # submits not yet accepted; meanwhile new calls for this actor gather in the queue
    live: str | None = None  # the actor incarnation that last answered
    dead: set[str] = field(default_factory=set)


class ToolPool:
    """`await pool.call(name, args)` always returns a ToolResult; failures come back as error results.

    Calls wait in one bounded queue; whatever is queued goes to an actor with free slots (up to its
    `max_concurrency`) in one submit message, and while a submit to an actor is unanswered, its next
    calls gather for the following one. A long poll per actor brings results back, many per
    message. Timeouts are enforced per call inside the actor, and by a watchdog here (with a little
    slack) in case the actor itself stops answering.

    With a `cache` (and `config.use_cache`), calls of cacheable tools are looked up first (a hit
    runs nothing) and their successful results stored; error results are never cached, since a
    timeout or crash need not repeat. The owner calls `cache.sync()` at step boundaries, which
    shares new results with the other ranks; until then they serve this rank's own later calls.
    """

    def __init__(self, config: ToolPoolConfig, cache: ToolArtifactCache | None = None):
        ensure_ray()
        self.config = config
        self.cache = cache if config.use_cache else None
        self._cacheable: frozenset[str] = frozenset()
        # Tool calls run as tasks inside the actor; the driver caps them at max_concurrency per actor.
        # The actor's own limit leaves room for its result poll and a control call beside that.
        actor_cls = ray.remote(ToolActor).options(
            num_cpus=config.num_cpus_per_actor, max_concurrency=config.max_concurrency + 2, max_restarts=-1
        )
        self.lanes = [_ActorLane(actor_cls.remote(config.tools), config.max_concurrency) for _ in range(config.num_actors)]
        self._metrics: dict[str, ToolMetrics] = defaultdict(ToolMetrics)
        self._queue: deque[_Request] | None = None
        self._room = asyncio.Semaphore(config.max_queue)  # places left in the queue
        self._wake = asyncio.Event()  # set when calls are queued or an actor can take more
        self._ids = itertools.count()
        self._tasks: set[asyncio.Task] = set()

    @property
    def actors(self) -> list[Any]:
        return [lane.actor for lane in self.lanes]

    async def start(self) -> list[dict[str, Any]]:
        """Build the tools in every actor (config errors surface here) and return their schemas."""
        schemas = await asyncio.gather(*(lane.actor.schemas.remote() for lane in self.lanes))
        if self.cache is not None:
            self._cacheable = frozenset(await self.lanes[0].actor.cacheable_tools.remote())
        self._queue = deque()
        self._spawn(self._dispatch_loop())
        for lane in self.lanes:
            self._spawn(self._result_loop(lane))
        self._spawn(self._watchdog())
        return schemas[0]

    async def call(self, name: str, args: dict[str, Any]) -> ToolResult:
        if self._queue is None:
            raise RuntimeError("ToolPool.call before `await pool.start()`")
        cached = name in self._cacheable
        if cached:
            hit = self.cache.get(name, args)
            if hit is not None:
                self._metrics[name].cache_hits += 1
                return ToolResult(hit.value, {**hit.metadata, "cache_hit": True})
            self._metrics[name].cache_misses += 1
        request = _Request(next(self._ids), name, args, asyncio.get_running_loop().create_future())
        await self._room.acquire()  # blocks while the queue is full: backpressure on the agent loop
        self._queue.append(request)
        self._wake.set()
        result = await request.done
        if cached and not result.is_error:
            self._store(name, args, result)
        return result

    def metrics(self) -> dict[str, dict[str, float]]:
        return {name: m.summary() for name, m in self._metrics.items()}

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for lane in self.lanes:
            ray.kill(lane.actor)
        self._queue = None

    def _store(self, name: str, args: dict[str, Any], result: ToolResult) -> None:
        try:
            self.cache.put(name, args, result.text, metadata=result.metadata)
        except (TypeError, ValueError):
            pass  # metadata JSON cannot encode: the result is returned, just not cached

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _dispatch_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(0)  # callers woken together queue their calls first, to share a submit
            for lane in sorted(self.lanes, key=lambda lane: lane.free, reverse=True):
                self._flush(lane)

    def _flush(self, lane: _ActorLane) -> None:
        """Submit queued calls to `lane`, as many as it has free slots, unless a submit to it is unanswered."""
        take = 0 if lane.sending else min(lane.free, len(self._queue))
        if not take:
            return
        batch = [self._queue.popleft() for _ in range(take)]
        for _ in range(take):
            self._room.release()
        lane.free -= take
        self._submit(lane, batch)

    def _submit(self, lane: _ActorLane, batch: list[_Request]) -> None:
        now = time.perf_counter()
        for request in batch:
            request.started = request.started or now
            request.incarnation = None
            lane.pending[request.rid] = request
        lane.sending += 1
        # Ray re-sends a submit that reached no live actor (e.g. one sent while it restarts); the
        # calls of an incarnation that died after accepting them are re-run by _rerun_or_fail.
        ref = lane.actor.submit.options(max_task_retries=_SUBMIT_RETRIES).remote(
            [(r.rid, r.name, r.args) for r in batch], self.config.call_timeout_s
        )
        self._spawn(self._await_acceptance(lane, batch, ref))

    async def _await_acceptance(self, lane: _ActorLane, batch: list[_Request], ref: Any) -> None:
        refusal = None
        try:
            incarnation = await ref
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            incarnation = None
        except ray.exceptions.RayError as exc:  # the actor refused the calls: its tools failed to (re)build
            incarnation, refusal = None, getattr(exc, "cause", None) or exc
        lane.sending -= 1
        accepted = [r for r in batch if r.rid in lane.pending]
        if refusal is not None:
            for request in accepted:
                error = f"tool '{request.name}' could not start: {type(refusal).__name__}: {refusal}"
                self._finish(lane, request, ToolResult(error, {"error_kind": "exception"}, True))
        elif incarnation is None or incarnation in lane.dead:
            self._rerun_or_fail(lane, accepted)
        else:
            for request in accepted:
                request.incarnation = incarnation
        self._flush(lane)  # the calls queued meanwhile, in one submit

    async def _result_loop(self, lane: _ActorLane) -> None:
        while True:
            try:
                incarnation, ready = await lane.actor.next_results.remote(lane.live)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                await asyncio.sleep(_RESTART_POLL_S)  # restarting: the next answer names the new incarnation
                continue
            if incarnation != lane.live:
                # A new incarnation answers: calls accepted by any other one died with it.
                if lane.live is not None:
                    lane.dead.add(lane.live)
                lane.live = incarnation
                lost = [r for r in lane.pending.values() if r.incarnation not in (None, incarnation)]
                self._rerun_or_fail(lane, lost)
            for rid, text, metadata, is_error in ready:
                request = lane.pending.get(rid)
                if request is not None:
                    self._finish(lane, request, ToolResult(text, metadata, is_error))
            if ready:
                # Callers these results woke queue their next calls first; they go to this actor
                # before the next poll does (no result can come back for it before then anyway).
                await asyncio.sleep(0)
                self._flush(lane)

    def _rerun_or_fail(self, lane: _ActorLane, lost: list[_Request]) -> None:
        # Ray restarts the actor (max_restarts=-1); each lost call runs once more on it.
        rerun = []
        for request in lost:
            self._metrics[request.name].actor_deaths += 1
            if request.reruns == 0:
                request.reruns = 1
                rerun.append(request)
            else:
                error = f"tool '{request.name}' crashed its worker twice"
                self._finish(lane, request, ToolResult(error, {"error_kind": "actor_died"}, True))
        if rerun:
            self._submit(lane, rerun)

    async def _watchdog(self) -> None:
        limit = self.config.call_timeout_s + _DRIVER_SLACK_S
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            now = time.perf_counter()
            for lane in self.lanes:
                for request in [r for r in lane.pending.values() if now - r.started > limit]:
                    error = f"tool '{request.name}' timed out after {self.config.call_timeout_s:g}s (its worker stopped answering)"
                    self._finish(lane, request, ToolResult(error, {"error_kind": "timeout"}, True))

    def _finish(self, lane: _ActorLane, request: _Request, result: ToolResult) -> None:
        del lane.pending[request.rid]
        lane.free += 1
        self._wake.set()
        self._metrics[request.name].record(result, time.perf_counter() - request.started)
        if not request.done.done():
            request.done.set_result(result)

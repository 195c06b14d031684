"""Ray tool pool: tools run in CPU Ray actors behind a bounded queue, with per-call timeouts,
one re-run after an actor death, per-tool metrics (calls, errors, timeouts, latency percentiles,
cache hits/misses), and results of cacheable tools answered from / stored in the artifact cache.

Ray places, starts and restarts the actors; the calls and their results travel over a socket of
their own between the driver and each actor (a Unix socket on the same node, TCP across nodes),
one length-prefixed pickle frame per batch. A Ray actor call costs ~1.5 ms each way on a loaded
2-core box, which was half of a 50 ms call's overhead; a socket frame costs ~0.1 ms."""
from __future__ import annotations

import asyncio
import functools
import hmac
import itertools
import os
import pickle
import struct
import sys
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
# Extra wait on the driver beyond the per-call timeout the actor enforces, for transport delays.
_DRIVER_SLACK_S = 2.0
_OPEN_RETRIES = 3
_RESTART_POLL_S = 0.1
_REFUSED_RETRY_S = 1.0  # an actor whose tools failed to build is asked again this often
_START_TIMEOUT_S = 120.0  # for `start` to reach every actor's call channel
_FRAME = struct.Struct("!Q")
CHANNELS = ("auto", "unix", "tcp")


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
    # How calls reach the actors: "auto" = a Unix socket to actors on the driver's node, TCP to the
    # others; "tcp" everywhere (e.g. actors in containers that do not share the driver's sockets).
    channel: str = "auto"

    def __post_init__(self) -> None:
        if self.channel not in CHANNELS:
            raise ValueError(f"tool_pool.channel: {self.channel!r} is not one of {', '.join(CHANNELS)}")

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


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    (size,) = _FRAME.unpack(await reader.readexactly(_FRAME.size))
    return pickle.loads(await reader.readexactly(size))


def _write_frame(writer: asyncio.StreamWriter, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    writer.writelines((_FRAME.pack(len(data)), data))


async def _open_connection(address: tuple) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    if address[0] == "unix":
        return await asyncio.open_unix_connection(address[1], limit=1 << 20)
    return await asyncio.open_connection(address[1], address[2], limit=1 << 20)


@dataclass(eq=False)
class _Submitted:
    """Calls started together: they share one deadline timer."""

    timer: asyncio.TimerHandle
    unfinished: int


class _Connection:
    """One driver's channel into an actor: the calls it started there, and their results not yet
    sent. Results finishing in the same event-loop turn leave in one frame."""

    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self.tasks: set[asyncio.Task] = set()
        # (call id, text, metadata, is_error): plain tuples pickle ~20x faster than ToolResults.
        self._finished: list[tuple[int, str, dict[str, Any], bool]] = []
        self._flush_scheduled = False

    def start(self, box: ToolBox, batch: list[tuple[int, str, dict[str, Any]]], timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(box.run(name, args)) for _, name, args in batch]
        # One timer per batch, not per call: its calls started together and share the deadline.
        submitted = _Submitted(loop.call_later(timeout_s, _cancel_all, tasks), len(tasks))
        for (rid, name, _), task in zip(batch, tasks):
            self.tasks.add(task)
            task.add_done_callback(functools.partial(self._done, rid, name, timeout_s, submitted))

    def _done(self, rid: int, name: str, timeout_s: float, submitted: _Submitted, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        submitted.unfinished -= 1
        if not submitted.unfinished:
            submitted.timer.cancel()
        if self.writer.is_closing():
            return  # the driver is gone: nobody reads this result
        if task.cancelled():
            self._finished.append((rid, f"tool '{name}' timed out after {timeout_s:g}s", {"error_kind": "timeout"}, True))
        elif task.exception() is not None:
            exc = task.exception()
            text = f"tool '{name}' failed: {type(exc).__name__}: {exc}"
            self._finished.append((rid, text, {"error_kind": "exception"}, True))
        else:
            result = task.result()
            self._finished.append((rid, result.text, result.metadata, result.is_error))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        ready, self._finished = self._finished, []
        if ready and not self.writer.is_closing():
            _write_frame(self.writer, ready)

    def close(self) -> None:
        """The driver went away: its calls still running here are cancelled (nobody would read them)."""
        self.writer.close()
        for task in list(self.tasks):
            task.cancel()


class ToolActor:
    """Holds one ToolBox in a Ray worker and serves calls over the channel that `open_channel`
    starts: the driver writes batches of calls, results come back as they finish. Tools are built
    lazily, so a restarted actor rebuilds them (and `open_channel` raises if it cannot)."""

    def __init__(self, specs: list[ToolSpec]):
        self._specs = specs
        self._box: ToolBox | None = None
        self._lock = asyncio.Lock()
        self._servers: dict[str, tuple[asyncio.AbstractServer, tuple]] = {}
        # The driver learns it through Ray; a connection that does not present it first is closed
        # before anything it sent is unpickled.
        self._token = os.urandom(32)
        # Tells the driver which incarnation it is connected to, to know what a crash lost.
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

    async def open_channel(self, driver_node_id: str | None, channel: str = "auto") -> tuple[str, tuple, bytes]:
        """Builds the tools (raising whatever stops them), starts this incarnation's server for
        `channel` once, and returns (incarnation, address, token) for the driver to connect."""
        await self._toolbox()
        if channel == "auto":
            same_node = driver_node_id is not None and driver_node_id == ray.get_runtime_context().get_node_id()
            channel = "unix" if same_node and sys.platform.startswith("linux") else "tcp"
        async with self._lock:
            if channel not in self._servers:
                if channel == "unix":  # Linux's abstract namespace: no file to clean up after a crash
                    name = f"\0rlf-tool-pool-{self.incarnation}"
                    server = await asyncio.start_unix_server(self._serve, path=name, limit=1 << 20)
                    address: tuple = ("unix", name)
                else:
                    host = ray.util.get_node_ip_address()
                    server = await asyncio.start_server(self._serve, host=host, port=0, limit=1 << 20)
                    address = ("tcp", host, server.sockets[0].getsockname()[1])
                self._servers[channel] = (server, address)
        return self.incarnation, self._servers[channel][1], self._token

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = _Connection(writer)
        try:
            if not hmac.compare_digest(await reader.readexactly(len(self._token)), self._token):
                return
            box = await self._toolbox()
            while True:
                timeout_s, batch = await _read_frame(reader)
                connection.start(box, batch, timeout_s)
        except (asyncio.IncompleteReadError, ConnectionError, EOFError, pickle.UnpicklingError):
            pass  # the driver closed its end, went away, or garbled a frame
        finally:
            connection.close()


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
    incarnation: str | None = None  # the actor incarnation it was sent to; None: not sent (yet, or again)
    reruns: int = 0


@dataclass
class _ActorLane:
    """Driver-side state of one actor: its channel, its free call slots and the calls it holds."""

    actor: Any
    free: int  # call slots not held by a pending call
    pending: dict[int, _Request] = field(default_factory=dict)
    writer: asyncio.StreamWriter | None = None  # None while (re)connecting
    incarnation: str | None = None  # the one at the other end of `writer`
    refusal: BaseException | None = None  # why its tools cannot be built, while they cannot
    channel: str = "auto"  # becomes "tcp" if a Unix socket turns out unreachable (another network namespace)
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # connected or refused once
    connect_error: str = "none yet"  # why the last attempt to connect failed, for start's error


class ToolPool:
    """`await pool.call(name, args)` always returns a ToolResult; failures come back as error results.

    Calls wait in one bounded queue; whatever is queued goes to an actor with free slots (up to its
    `max_concurrency`) as one frame on its channel, and results come back as they finish, many per
    frame. Timeouts are enforced per call inside the actor, and by a watchdog here (with a little
    slack) in case the actor itself stops answering. A channel that breaks means its actor died
    (Ray restarts it): the calls sent on it run once more on the new incarnation.

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
        # Tool calls run as tasks in the actor's event loop, not as Ray calls: Ray carries only
        # control calls (schemas, open_channel, pid), a few at a time.
        actor_cls = ray.remote(ToolActor).options(num_cpus=config.num_cpus_per_actor, max_concurrency=8, max_restarts=-1)
        self.lanes = [_ActorLane(actor_cls.remote(config.tools), config.max_concurrency, channel=config.channel)
                      for _ in range(config.num_actors)]
        self._metrics: dict[str, ToolMetrics] = defaultdict(ToolMetrics)
        self._queue: deque[_Request] | None = None
        self._room = asyncio.Semaphore(config.max_queue)  # places left in the queue
        self._wake = asyncio.Event()  # set when calls are queued or an actor can take more
        self._ids = itertools.count()
        self._tasks: set[asyncio.Task] = set()
        self._node_id = ray.get_runtime_context().get_node_id()

    @property
    def actors(self) -> list[Any]:
        return [lane.actor for lane in self.lanes]

    async def start(self) -> list[dict[str, Any]]:
        """Build the tools in every actor (config errors surface here), connect to each, and
        return the tools' schemas."""
        schemas = await asyncio.gather(*(lane.actor.schemas.remote() for lane in self.lanes))
        if self.cache is not None:
            self._cacheable = frozenset(await self.lanes[0].actor.cacheable_tools.remote())
        self._queue = deque()
        self._spawn(self._dispatch_loop())
        for lane in self.lanes:
            self._spawn(self._lane_loop(lane))
        self._spawn(self._watchdog())
        for index, lane in enumerate(self.lanes):
            try:
                await asyncio.wait_for(lane.settled.wait(), _START_TIMEOUT_S)
            except asyncio.TimeoutError:
                await self.close()
                raise RuntimeError(
                    f"tool actor {index}: no connection to its call channel within {_START_TIMEOUT_S:g}s "
                    f"(last error: {lane.connect_error}); across nodes the actors listen on TCP at their node's IP "
                    "(an ephemeral port): check that this process can reach it") from None
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
            if lane.writer is not None:
                lane.writer.close()
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
            await asyncio.sleep(0)  # callers woken together queue their calls first, to share a frame
            # Connected actors first, the freest first; an actor that cannot build its tools last.
            for lane in sorted(self.lanes, key=lambda lane: (lane.refusal is None, lane.free), reverse=True):
                self._flush(lane)

    def _flush(self, lane: _ActorLane) -> None:
        """Send queued calls to `lane`, as many as it has free slots (none while it reconnects)."""
        if not self._queue or (lane.writer is None and lane.refusal is None):
            return
        take = min(lane.free, len(self._queue))
        if not take:
            return
        batch = [self._queue.popleft() for _ in range(take)]
        for _ in range(take):
            self._room.release()
        lane.free -= take
        now = time.perf_counter()
        for request in batch:
            request.started = now
            lane.pending[request.rid] = request
        if lane.refusal is not None:
            self._refuse(lane, batch)
        else:
            self._submit(lane, batch)

    def _submit(self, lane: _ActorLane, batch: list[_Request]) -> None:
        """Write `batch` (pending on `lane`) to its channel as one frame."""
        for request in batch:
            request.incarnation = lane.incarnation
        try:
            _write_frame(lane.writer, (self.config.call_timeout_s, [(r.rid, r.name, r.args) for r in batch]))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:  # arguments that cannot travel
            for request in batch:
                error = f"tool '{request.name}': arguments cannot be sent to its worker: {type(exc).__name__}: {exc}"
                self._finish(lane, request, ToolResult(error, {"error_kind": "exception"}, True))

    def _refuse(self, lane: _ActorLane, requests: list[_Request]) -> None:
        for request in requests:
            error = f"tool '{request.name}' could not start: {type(lane.refusal).__name__}: {lane.refusal}"
            self._finish(lane, request, ToolResult(error, {"error_kind": "exception"}, True))

    async def _lane_loop(self, lane: _ActorLane) -> None:
        while True:
            reader = await self._connect(lane)
            try:
                while True:
                    ready = await _read_frame(reader)
                    for rid, text, metadata, is_error in ready:
                        request = lane.pending.get(rid)
                        if request is not None and request.incarnation == lane.incarnation:
                            self._finish(lane, request, ToolResult(text, metadata, is_error))
                    # Callers these results woke queue their next calls first; they go out in one frame.
                    await asyncio.sleep(0)
                    self._flush(lane)
            except (asyncio.IncompleteReadError, ConnectionError, OSError, EOFError, pickle.UnpicklingError):
                pass  # the actor died (Ray restarts it), or the connection broke (or garbled a frame)
            lane.writer.close()
            lane.writer = None
            # The calls sent to that incarnation died with it.
            self._rerun_or_fail(lane, [r for r in lane.pending.values() if r.incarnation == lane.incarnation])

    async def _connect(self, lane: _ActorLane) -> asyncio.StreamReader:
        """Until connected to the actor's current incarnation; meanwhile calls for it wait (or,
        while its tools cannot be built, fail at once)."""
        while True:
            address = None
            try:
                incarnation, address, token = await lane.actor.open_channel.options(
                    max_task_retries=_OPEN_RETRIES).remote(self._node_id, lane.channel)
                reader, writer = await _open_connection(address)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, OSError) as exc:
                lane.connect_error = f"{type(exc).__name__}: {exc}" + (f" (address {address})" if address else "")
                if address is not None and address[0] == "unix" and self.config.channel == "auto":
                    lane.channel = "tcp"  # the actor's Unix socket is not visible from here
                await asyncio.sleep(_RESTART_POLL_S)  # restarting
                continue
            except ray.exceptions.RayError as exc:  # its tools failed to (re)build
                lane.refusal = getattr(exc, "cause", None) or exc
                self._refuse(lane, [r for r in lane.pending.values() if r.incarnation is None])
                lane.settled.set()
                self._wake.set()  # queued calls for it fail now rather than wait
                await asyncio.sleep(_REFUSED_RETRY_S)
                continue
            writer.write(token)
            lane.writer, lane.incarnation, lane.refusal = writer, incarnation, None
            unsent = [r for r in lane.pending.values() if r.incarnation is None]  # re-runs
            if unsent:
                self._submit(lane, unsent)
            lane.settled.set()
            self._wake.set()
            return reader

    def _rerun_or_fail(self, lane: _ActorLane, lost: list[_Request]) -> None:
        # Ray restarts the actor (max_restarts=-1); each lost call runs once more on it.
        for request in lost:
            self._metrics[request.name].actor_deaths += 1
            if request.reruns == 0:
                request.reruns = 1
                request.incarnation = None  # sent again once reconnected
            else:
                error = f"tool '{request.name}' crashed its worker twice"
                self._finish(lane, request, ToolResult(error, {"error_kind": "actor_died"}, True))

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

"""vLLM engines hosted in Ray actors (disaggregated rollout) and the broadcast transport that feeds them.

Weights travel over one process group of their own: the sending training rank and every
engine actor (gloo on CPU, NCCL on GPU), one broadcast per bucket however many engines there
are. Each bucket is one flat byte buffer; its layout (names, dtypes, shapes) goes with the Ray
call that receives it. An engine with TP workers hands the received bucket on to them by handle.
"""
from __future__ import annotations

import pickle
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from rlfactory_megatron.rollout.engines import Generation, SamplingConfig, VLLMEngine
from rlfactory_megatron.rollout.handoff import bucket_layout, pack_into, packed_size, unpack
from rlfactory_megatron.rollout.weight_sync import TRANSPORTS, EngineLostError, Transport


def _weight_group(host: str, port: int, rank: int, size: int, backend: str, timeout_s: float, store=None):
    """A process group of the sender (rank 0, which brings its `store`) and its engines,
    independent of any torch.distributed world."""
    if store is None:
        store = dist.TCPStore(host, port, world_size=size, is_master=False, timeout=timedelta(seconds=timeout_s))
    if backend == "nccl":
        # The same bound as gloo's: a member that stops answering fails the broadcast after timeout_s.
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s))


def _leave(group) -> None:
    """This member's end of a weight group: aborted, which frees an NCCL communicator's device
    memory and channels at once (a shutdown would wait for members that may be gone)."""
    try:
        group.abort()
    except Exception:  # noqa: BLE001 - a group broken (or aborted) already is left all the same
        pass


def _broadcast_from_sender(group, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


class VLLMEngineHost:
    """The body of the Ray actor: one VLLMEngine plus the receiving end of the weight group.

    An async actor: `stream` calls run at once on its event loop, all through one
    StreamingFront that steps the engine in a thread of its own, so a call that arrives joins the
    running batch at the next step. The plain methods (weight loading among them) run between
    streams: the router pauses engine calls for a weight sync, and under partial rollout
    `interrupt`s the requests under way first (they go on as new requests on the new weights)."""

    def __init__(self, hf_dir: str, **engine_kwargs) -> None:
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        # TP workers each read the bucket on their own device (the actor's devices, in order).
        workers = [torch.device("cuda", r) for r in range(engine_kwargs.get("tensor_parallel_size", 1))]
        self.engine = VLLMEngine(hf_dir, in_process=True, **engine_kwargs,
                                 staging_devices=workers if self.device.type == "cuda" else None)
        self.front = None  # the StreamingFront, made by the first stream or interrupt
        self.group = None

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seeds=None) -> list[list[Generation]]:
        return self.engine.generate(prompts, sampling, seeds)

    def classify(self, prompts: list[list[int]]) -> list[list[float]]:
        return self.engine.classify(prompts)

    async def stream(self, prompts: list[list[int]], samplings: list[SamplingConfig]):
        """Yields `(index, (token_ids, log_probs))` as each request finishes, or `(index, exception)`
        for a request the engine refused; a cancelled call aborts its unfinished requests."""
        import asyncio

        front = self._front()

        async def one(index: int):
            try:
                return index, await front.generate(prompts[index], samplings[index])
            except Exception as exc:  # noqa: BLE001 - that request's error, for its caller
                return index, exc

        requests = [asyncio.ensure_future(one(index)) for index in range(len(prompts))]
        try:
            for finished in asyncio.as_completed(requests):
                yield await finished
        finally:
            for request in requests:
                request.cancel()

    def _front(self):
        from rlfactory_megatron.rollout.fronts import StreamingFront

        if self.front is None:
            self.front = StreamingFront(self.engine)
        return self.front

    async def interrupt(self) -> None:
        """Ends the requests in the engine after its current step (partial rollout); see StreamingFront."""
        await self._front().interrupt()

    async def release(self) -> None:
        await self._front().release()

    def engine_steps(self) -> int:
        """Forward passes the engine has made for `stream` calls."""
        return self.front.steps if self.front is not None else 0

    def weight_names(self) -> dict[str, tuple[int, ...]]:
        return self.engine.weight_names()

    def join_weight_group(self, host: str, port: int, rank: int, size: int, backend: str, timeout_s: float) -> bool:
        """Joins a new group of the sender and the engines (after a replacement: the old one is left)."""
        if self.group is not None:
            _leave(self.group)
        self.group = _weight_group(host, port, rank, size, backend, timeout_s)
        return True

    def receive_bucket(self, layout: dict) -> int:
        """Receives one bucket and loads it; returns the bytes of the messages that carried it on
        to the engine's workers (none when they live in this process)."""
        from vllm.utils.nccl import unpinned_nccl_env

        buffer = torch.empty(packed_size(layout), dtype=torch.uint8, device=self.device)
        # NCCL makes its communicator at the first broadcast, from the environment then: without the
        # NCCL settings vLLM's batch-invariant mode pins for its own, which the sender does not have.
        with unpinned_nccl_env():
            _broadcast_from_sender(self.group, buffer)
        sent = self.engine.message_bytes
        self.engine.load_weights(unpack(buffer, layout))
        return self.engine.message_bytes - sent

    def finish_weight_update(self) -> None:
        self.engine.finish_weight_update()

    def sleep(self, level: int = 2) -> None:
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine.wake_up(tags)

    async def close(self) -> None:
        if self.front is not None:
            await self.front.close()
        if self.group is not None:
            _leave(self.group)
        self.engine.close()


class RayVLLMEngine:
    """Client for a VLLMEngineHost actor with the rollout-engine interface (blocking calls)."""

    def __init__(self, hf_dir: str, num_cpus: float = 1, num_gpus: float = 0, name: str | None = None,
                 env: dict[str, str] | None = None, **engine_kwargs) -> None:
        import ray

        host_cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(VLLMEngineHost)
        self._ray, self.name = ray, name
        # max_restarts=0: a dead engine is replaced by its owner, with the weights of the next sync.
        # `env`: the actor's environment variables (a colocated judge's devices: its owner's).
        options = {"runtime_env": {"env_vars": env}} if env else {}
        self.actor = host_cls.options(name=name, max_restarts=0, **options).remote(hf_dir, **engine_kwargs)
        self._weight_names: dict[str, tuple[int, ...]] | None = None

    def generate(self, prompts, sampling, seeds=None):
        return self._ray.get(self.actor.generate.remote(prompts, sampling, seeds))

    async def stream(self, prompts: list[list[int]], samplings: list[SamplingConfig]):
        """`(index, result)` as each request finishes in the actor (one call, streamed returns);
        see `fronts.RemoteFront`. Leaving early cancels the call."""
        returns = self.actor.stream.options(num_returns="streaming").remote(prompts, samplings)
        complete = False
        try:
            async for ref in returns:
                yield await ref
            complete = True
        finally:
            if not complete:
                try:
                    self._ray.cancel(returns)
                except Exception:  # noqa: BLE001 - the actor is gone already
                    pass

    async def classify(self, prompts: list[list[int]]) -> list[list[float]]:
        """A pooling engine's class logits of each sequence (see VLLMEngine.classify)."""
        return await self.actor.classify.remote(prompts)

    async def interrupt(self) -> None:
        await self.actor.interrupt.remote()

    async def release(self) -> None:
        await self.actor.release.remote()

    def sleep(self, level: int = 2) -> None:
        self._ray.get(self.actor.sleep.remote(level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._ray.get(self.actor.wake_up.remote(tags))

    def weight_names(self):
        """The names and shapes a sync must deliver: those of the checkpoint the actor started from,
        fixed for its life, so asked once (not one blocking round trip per engine per sync)."""
        if self._weight_names is None:
            self._weight_names = self._ray.get(self.actor.weight_names.remote())
        return dict(self._weight_names)

    def close(self) -> None:
        try:
            self._ray.get(self.actor.close.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - already dead or stuck: killing it is all that is left
            pass
        self._ray.kill(self.actor, no_restart=True)
        # The kill is asynchronous; the name is free only once the actor is gone, and an engine
        # started next in this Ray session (a test's, a restarted judge's) may take it.
        deadline = time.monotonic() + 30
        while self.name is not None and time.monotonic() < deadline:
            try:
                self._ray.get_actor(self.name)
            except ValueError:
                return
            time.sleep(0.1)


@TRANSPORTS.register("broadcast")
class BroadcastTransport(Transport):
    """Sends buckets from this training rank to one or more RayVLLMEngines: one group of the
    sender and every engine, one broadcast per bucket (not one send per engine)."""

    def __init__(self, engines: RayVLLMEngine | list[RayVLLMEngine], host: str = "127.0.0.1",
                 timeout_s: float = 600.0) -> None:
        self.engines = engines if isinstance(engines, list) else [engines]
        self._ray = self.engines[0]._ray
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        backend = self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        size = len(self.engines) + 1
        # The store listens on a port the OS picks (a port picked beforehand can be taken meanwhile).
        store = dist.TCPStore(host, 0, world_size=size, is_master=True, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        # Every member must construct the group at the same time: start the remote sides first.
        joined = [engine.actor.join_weight_group.remote(host, store.port, rank, size, backend, timeout_s)
                  for rank, engine in enumerate(self.engines, start=1)]
        self.group = _weight_group(host, store.port, 0, size, backend, timeout_s, store=store)
        self._store = store
        self._ray.get(joined, timeout=timeout_s)  # an engine that never joins fails here, not in a hang

    def expected_weights(self):
        names = [engine.weight_names() for engine in self.engines]
        if any(other != names[0] for other in names[1:]):
            raise RuntimeError("the engines serve different models: their weight names or shapes differ")
        return names[0]

    def send(self, bucket):
        layout = bucket_layout(bucket)
        flat = torch.empty(packed_size(layout), dtype=torch.uint8, device=self.device)
        pack_into(flat, bucket, layout)
        received = [engine.actor.receive_bucket.remote(layout) for engine in self.engines]
        try:
            _broadcast_from_sender(self.group, flat)
            self.message_bytes += len(self.engines) * len(pickle.dumps(layout)) + sum(self._ray.get(received))
        except Exception as exc:  # noqa: BLE001 - sorted out below
            self._raise_lost(received, exc)

    def finish(self):
        finished = [engine.actor.finish_weight_update.remote() for engine in self.engines]
        try:
            self._ray.get(finished)
        except Exception as exc:  # noqa: BLE001 - sorted out below
            # No broadcast in a finish: a live engine's call ends, however long its loader takes.
            self._raise_lost(finished, exc, in_broadcast=False)

    def close(self) -> None:
        """Leaves the group (the engines leave theirs as they join the next, or close)."""
        _leave(self.group)
        self._store = None

    def _raise_lost(self, calls: list, exc: Exception, in_broadcast: bool = True) -> None:
        """An engine that died takes the group with it: the others' calls end with an error, or
        wait in the broken broadcast (gloo until its timeout, NCCL for good). Engines whose call
        failed because their actor died, or that still wait in a broadcast after WEDGED_AFTER_S,
        are lost (their owner replaces them); the others end their update, so that they serve
        until the sync runs again. Under NCCL a broken broadcast leaves every member's stream
        waiting on it: the sender aborts its communicator and every engine is lost. Any other
        failure is the caller's, as it was."""
        from ray.exceptions import RayActorError

        from rlfactory_megatron.rollout.router import error_line

        done, _ = self._ray.wait(calls, num_returns=len(calls), timeout=WEDGED_AFTER_S if in_broadcast else None)
        lost, whys = [], []
        for index, call in enumerate(calls):
            try:
                if call in done:
                    self._ray.get(call)
                    continue
                why = f"still in the broken broadcast after {WEDGED_AFTER_S:.0f} s"
            except RayActorError as died:
                why = error_line(died)
            except Exception:  # noqa: BLE001 - the group broke under this live engine: it stays
                continue
            lost.append(index)
            whys.append(f"engine {index}: {why}")
        if not lost:
            raise exc
        if in_broadcast and self.backend == "nccl":
            _leave(self.group)  # frees this rank's stream from the broadcast that never ends
            whys += [f"engine {index}: in the broken NCCL broadcast" for index in range(len(self.engines))
                     if index not in lost]
            lost = list(range(len(self.engines)))
        survivors = [engine.actor.finish_weight_update.remote() for index, engine in enumerate(self.engines)
                     if index not in lost]
        try:
            self._ray.get(survivors, timeout=WEDGED_AFTER_S)
        except Exception:  # noqa: BLE001 - the sync runs again to all of them anyway
            pass
        raise EngineLostError(lost, "weight sync cut short: " + "; ".join(whys)) from exc


# After a broadcast broke, how long an engine's call may go on before the engine counts as wedged.
WEDGED_AFTER_S = 10.0

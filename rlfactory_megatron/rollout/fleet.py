"""The engines of a run: started (colocated, one per `rollout.tp` training ranks, or a disaggregated
pool of Ray actors behind a router), fed the actor's weights, replaced when they die, put to
sleep while training holds the devices. The fleet owns the event loop every engine call runs on."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Coroutine, Sequence

import torch

from rlfactory_megatron.runtime.collectives import RankCollectives

# What an engine's sleep gives up, as vLLM tags it, in the order a weight update wakes it.
ENGINE_MEMORY = ("weights", "kv_cache")
# A disaggregated engine that dies at this many weight syncs in a row ends the run.
MAX_ENGINE_DEATHS_IN_A_ROW = 3
# How long a live engine may take to answer the check before a sync.
ENGINE_PING_TIMEOUT_S = 120


@dataclass(frozen=True)
class EngineLayout:
    """Which training ranks generate (the producers: each drives engines and runs agent loops on
    them): the first of each group of `rollout_tp` ranks (colocated, each owns one engine)."""

    world: int
    rollout_tp: int
    rank: int

    @property
    def num_producers(self) -> int:
        return self.world // self.rollout_tp

    @property
    def producer(self) -> int | None:
        """This rank's index among the producers, or None when it does not generate."""
        return self.rank // self.rollout_tp if self.rank % self.rollout_tp == 0 else None

    @property
    def owners(self) -> list[int]:
        """The producers' ranks."""
        return [producer * self.rollout_tp for producer in range(self.num_producers)]

    def share(self, count: int, producer: int) -> range:
        """The contiguous part of `count` prompts that `producer` generates."""
        n = self.num_producers
        return range(producer * count // n, (producer + 1) * count // n)


class EngineFleet:
    """This process's engines (when it owns any) and the router in front of them; every method
    is called on every training rank. Disaggregated, rank 0 drives every engine (through the
    router), so it is the one generating process; colocated, the first rank of each
    rollout.tp group."""

    def __init__(self, cfg, hf_dir: str, output: Path, collectives: RankCollectives) -> None:
        self.cfg, self.hf_dir, self.output = cfg, hf_dir, output
        self.disaggregated = cfg.rollout.mode == "disaggregated"
        world = collectives.world
        self.layout = EngineLayout(world, world if self.disaggregated else cfg.rollout.tp, collectives.rank)
        self.engine = self.router = self.transport = None
        self.pool: list = []  # disaggregated: the engines (Ray actors)
        self._deaths_in_a_row: dict[int, int] = {}
        self._replaced = 0
        self._asleep: set[str] = set()  # the engine memory (ENGINE_MEMORY tags) its sleep gave up
        self._last_sync = None  # SyncStats of the last weight sync this rank sent
        self._loop = asyncio.new_event_loop()
        # Asynchronous RL: the loop (agent loops, tools, engine calls) runs on a thread of its own,
        # so that generation goes on while this thread trains; work is handed to it by `run`.
        self._loop_thread = None
        if cfg.trainer.max_staleness > 0:
            self._loop_thread = threading.Thread(target=self._loop.run_forever, name="rlf-rollout-loop", daemon=True)
            self._loop_thread.start()
        ray_join = collectives.broadcast(self._start_ray() if self.layout.rank == 0 else None)
        if self.generates:
            self._start_engines(*ray_join)

    @property
    def generates(self) -> bool:
        """Whether this process drives engines (and runs the agent loops on them)."""
        return self.layout.producer is not None

    # ------------------------------------------------------------------ the event loop
    def run(self, coroutine: Coroutine) -> Any:
        """Run `coroutine` on the fleet's event loop and return its result."""
        if self._loop_thread is None:
            return self._loop.run_until_complete(coroutine)
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def submit(self, coroutine: Coroutine) -> concurrent.futures.Future:
        """Start `coroutine` on the fleet's event loop: under way on its thread (asynchronous RL),
        else run to its end here."""
        if self._loop_thread is not None:
            return asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        return done(self._loop.run_until_complete(coroutine))

    # ------------------------------------------------------------------ start-up
    def _start_ray(self) -> tuple[str, dict[str, str]]:
        """Rank 0: one Ray per job, the sbatch script's (RAY_ADDRESS) or a local one started here
        with enough logical CPUs for every engine process's tool and reward actors at once.
        Returns what the other engine processes need to join it: its address and the variables
        of its token authentication (on by default for a local cluster since Ray 2.59)."""
        import ray

        judge = self.cfg.reward.model
        # A judge's engines: reward.model.num_engines Ray actors per engine process; placed on
        # devices of their own (own), they count among the Ray cluster's GPUs too.
        judge_actors = judge.num_engines * self.layout.num_producers if judge.kind is not None else 0
        own_judge = judge_actors if judge.placement == "own" else 0
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            per_engine = self.cfg.tools.num_workers + self.cfg.reward.num_workers
            needed = per_engine * self.layout.num_producers + 1 + judge_actors
            if self.disaggregated:
                needed += self.cfg.rollout.num_engines * self.cfg.rollout.tp
            with _engine_gpus_only((self.disaggregated or own_judge > 0) and not address, self.layout.world) as gpus:
                # "local": without RAY_ADDRESS a fresh cluster, never one a `ray start` on this host
                # left running (or a stale record of one in /tmp/ray) that Ray would otherwise join.
                ray.init(address=address or "local", num_cpus=None if address else max(needed, os.cpu_count() or 2),
                         num_gpus=gpus, include_dashboard=False, log_to_driver=False)
        if (self.disaggregated or own_judge) and torch.cuda.is_available():
            wanted = self.cfg.rollout.num_engines * self.cfg.rollout.tp * self.disaggregated + own_judge * judge.tp
            have = ray.cluster_resources().get("GPU", 0)
            if have < wanted:  # the actors would wait for devices that never come
                raise ValueError(f"rollout.num_engines={self.cfg.rollout.num_engines} x rollout.tp={self.cfg.rollout.tp} "
                                 f"engine GPUs and {own_judge} x reward.model.tp={judge.tp} judge GPUs ({wanted:g}), "
                                 f"but the Ray cluster has {have:g} besides the training ranks'; lower "
                                 "rollout.num_engines or give the job more GPUs (slurm/train.sbatch gives Ray the "
                                 "GPUs of each node that its RLF_GPUS_PER_NODE ranks leave)")
        auth = {}
        if os.environ.get("RAY_AUTH_MODE") == "token":
            token = os.environ.get("RAY_AUTH_TOKEN")
            if not token:
                path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
                token = path.read_text().strip() if path.is_file() else None
            auth = {"RAY_AUTH_MODE": "token", **({"RAY_AUTH_TOKEN": token} if token else {})}
        return ray.get_runtime_context().gcs_address, auth

    def _start_engines(self, ray_address: str, ray_auth: dict[str, str]) -> None:
        # Before anything imports Ray (vLLM does): Ray reads its authentication mode once.
        for key, value in ray_auth.items():
            os.environ.setdefault(key, value)
        import ray

        from rlfactory_megatron.rollout.fronts import serving
        from rlfactory_megatron.rollout.engines import build_engine
        from rlfactory_megatron.rollout.router import EngineRouter
        from rlfactory_megatron.rollout.weight_sync import TRANSPORTS

        cfg = self.cfg
        engine_args = dict(dtype=cfg.model.params_dtype, tensor_parallel_size=cfg.rollout.tp,
                           max_model_len=cfg.rollout.max_prompt_tokens + cfg.rollout.max_response_tokens,
                           max_num_seqs=cfg.rollout.max_num_seqs, memory_utilization=cfg.rollout.gpu_memory_utilization,
                           seed=cfg.trainer.seed, batch_invariant=cfg.rollout.batch_invariant,
                           record_routes=bool(cfg.rollout.record_routes))  # resolved at load (R3 needs them)
        if self.disaggregated:
            if not ray.is_initialized():
                ray.init(address=ray_address, include_dashboard=False, log_to_driver=False)
            self._engine_args = engine_args
            self.pool = [self._new_pool_engine(index) for index in range(cfg.rollout.num_engines)]
            self.transport = self._pool_transport()
            engines = self.pool
        else:
            with _engine_devices(self.layout):
                self.engine = build_engine(cfg.rollout.engine, self.hf_dir, enable_sleep_mode=torch.cuda.is_available(),
                                           **engine_args)
            self.transport = TRANSPORTS.get(cfg.weight_sync.transport)(self.engine)
            engines = [self.engine]
            if not ray.is_initialized():  # after vLLM: with Ray up, its TP>1 engine would pick Ray's executor
                ray.init(address=ray_address, include_dashboard=False, log_to_driver=False)
        self.router = EngineRouter([serving(engine) for engine in engines], is_failure=engine_died)

    # ------------------------------------------------------------------ weights
    def update_weights(self, model, version: int) -> None:
        """`model`'s weights (a training model's megatron state) into every engine in one
        collective sync (disaggregated engines that died since the last one are replaced first,
        so they serve these weights). With generation in flight (asynchronous RL), engine calls
        pause for it: calls under way end after their engine's current decode step (partial
        rollout) or finish on the old weights, and go on on the new ones."""
        from rlfactory_megatron.rollout.weight_sync import EngineLostError, WeightSyncError, sync_weights

        paused = self._loop_thread is not None and self.router is not None
        if paused:
            self.run(self.router.pause(interrupt=self.cfg.trainer.partial_rollout))
        try:
            # An engine that dies during the sync is replaced and the whole sync runs again (the
            # others hold layers of two versions); one that keeps dying ends the run there.
            for attempt in range(1, MAX_ENGINE_DEATHS_IN_A_ROW + 1):
                # The pool lives on the sending rank only: its failure to replace an engine goes
                # into the sync as a refusal, so every rank stops with it (not in a collective).
                failure = None
                if self.pool:
                    try:
                        self._replace_failed_engines()
                    except Exception as exc:  # noqa: BLE001 - reraised on every rank below
                        failure = exc
                try:
                    self._last_sync = sync_weights(model, self.transport, self.cfg.weight_sync.bucket_mb,
                                                   version=version, refusal=None if failure is None else _refusal(failure))
                    break
                except WeightSyncError as exc:
                    raise exc from failure
                except EngineLostError as exc:
                    if attempt == MAX_ENGINE_DEATHS_IN_A_ROW:
                        raise RuntimeError(f"the weight sync to version {version} failed {attempt} times: {exc}; "
                                           f"the engines' logs are in {self.output / 'logs'}") from exc
                    if exc.lost:  # the sending rank
                        print(f"rlf-train: {exc}; syncing again", flush=True)
                        for index in exc.lost:
                            self.router.fail(index, exc)
        finally:
            if self.router is not None:
                # A sync cut short leaves the engines serving (layers of both versions): the version
                # stays the last complete one.
                self.run(self.router.resume(self.transport.served_version))

    def sync_metrics(self) -> dict[str, float]:
        """The last sync's model bytes and the bytes of the engine calls that carried them (on a
        rank that sent one: the weights go by handle or broadcast, so these stay small)."""
        stats = self._last_sync
        if stats is None:
            return {}
        return {"weight_sync/bytes": float(stats.bytes), "weight_sync/message_bytes": float(stats.message_bytes)}

    def _replace_failed_engines(self) -> None:
        """A fresh actor for each engine that died (its requests already ran elsewhere), and a
        broadcast group with it; an engine that died at MAX_ENGINE_DEATHS_IN_A_ROW syncs in a row
        ends the run instead of failing forever."""
        import ray

        from rlfactory_megatron.rollout.fronts import serving

        self._check_pool_alive()
        failed = dict(self.router.failed)
        for index in range(len(self.pool)):
            self._deaths_in_a_row[index] = self._deaths_in_a_row.get(index, 0) + 1 if index in failed else 0
        for index, why in sorted(failed.items()):
            if self._deaths_in_a_row[index] >= MAX_ENGINE_DEATHS_IN_A_ROW:
                raise RuntimeError(f"rollout engine {index} died at {self._deaths_in_a_row[index]} syncs in a row "
                                   f"(last: {why}); its log is in {self.output / 'logs'}")
            print(f"rlf-train: rollout engine {index} died ({why}); starting a new one", flush=True)
            try:
                ray.kill(self.pool[index].actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            self.run(self.router.fronts[index].close())
            self._replaced += 1
            self.pool[index] = self._new_pool_engine(index, self._replaced)
            self.router.revive(index, serving(self.pool[index]))
        if failed:  # the group of the sender and every engine, the new ones included
            served = self.transport.served_version
            self.transport.close()  # its NCCL communicator, on this rank and the surviving engines
            self.transport = self._pool_transport()
            self.transport.served_version = served

    def _new_pool_engine(self, index: int, replacement: int = 0):
        """Pool engine `index` in a Ray actor of its own: devices of its own (Ray resources:
        rollout.tp GPUs, or one CPU), no sleep mode. Named rlf-engine-<i> (a replacement:
        rlf-engine-<i>-<n>; a killed actor's name may not be free yet), so that tools and
        operators can find them."""
        from rlfactory_megatron.rollout.ray_engine import RayVLLMEngine

        gpus = self.cfg.rollout.tp if torch.cuda.is_available() else 0
        name = f"rlf-engine-{index}" + (f"-{replacement}" if replacement else "")
        return RayVLLMEngine(self.hf_dir, num_cpus=1, num_gpus=gpus, name=name, **self._engine_args)

    def _pool_transport(self):
        """The weight group of this rank and every pool engine, at an address engines on other
        nodes reach."""
        import ray

        from rlfactory_megatron.rollout.weight_sync import TRANSPORTS

        return TRANSPORTS.get(self.cfg.weight_sync.transport)(self.pool, host=ray.util.get_node_ip_address())

    def _check_pool_alive(self) -> None:
        """Engines that died between steps (no request saw it) count as failed, so the sync does
        not stream into a dead actor."""
        import ray

        # All pinged at once, under one deadline: a wedged engine costs the timeout once, not per engine.
        pings = {index: engine.actor.weight_names.remote() for index, engine in enumerate(self.pool)
                 if index not in self.router.failed}
        deadline = time.monotonic() + ENGINE_PING_TIMEOUT_S
        for index, ping in pings.items():
            try:
                ray.get(ping, timeout=max(deadline - time.monotonic(), 0.0))
            except Exception as exc:  # noqa: BLE001 - dead, or wedged: replaced either way
                self.router.fail(index, exc)

    # ------------------------------------------------------------------ device memory
    def sleep(self, level: int = 2) -> None:
        """This process's engine gives its device memory to training (vLLM's sleep mode, GPU
        only). Level 2 drops its weights and KV cache: the weights wake first, for a weight sync
        to fill; level 1 keeps the weights in host memory, for work no sync follows."""
        if self.engine is not None and not self._asleep:
            self.engine.sleep(level)
            self._asleep = set(ENGINE_MEMORY)

    def wake_up(self, tags: Sequence[str] = ENGINE_MEMORY) -> None:
        """Give back the engine memory `tags` name (of those asleep): after a level-2 sleep,
        "weights", then the sync, then "kv_cache" (vLLM's order for a weight update)."""
        waking = [tag for tag in ENGINE_MEMORY if tag in tags and tag in self._asleep]
        if waking:
            self.engine.wake_up(waking)
            self._asleep -= set(waking)

    def close(self) -> None:
        if self.router is None:
            return
        for front in self.router.fronts:  # their batching tasks end with the loop
            self.run(front.close())
        if self._loop_thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(timeout=30)
        if self.transport is not None:
            self.transport.close()
        for engine in [self.engine, *self.pool]:
            if engine is not None:
                engine.close()


def done(result) -> concurrent.futures.Future:
    """A future that already holds `result`."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(result)
    return future


def _refusal(failure: Exception) -> str:
    """Why the sending rank cannot sync, in one line for every rank's error."""
    from rlfactory_megatron.rollout.router import error_line

    if type(failure) is RuntimeError:  # ours: already says what happened and where the logs are
        return str(failure)
    return f"a new rollout engine could not start: {error_line(failure)}"


def engine_died(exc: BaseException) -> bool:
    """Whether an engine call failed because the engine is gone (its requests can run elsewhere):
    its Ray actor died, or the vLLM engine inside failed a step while the actor lives on."""
    from ray.exceptions import RayActorError

    from rlfactory_megatron.rollout.fronts import EngineStepError

    return isinstance(exc, (RayActorError, EngineStepError))


@contextlib.contextmanager
def _engine_gpus_only(local_cluster: bool, world: int):
    """Starting a local Ray for disaggregated engines on GPU: Ray sees only this node's devices
    the training ranks do not use (local ranks take devices 0..LOCAL_WORLD_SIZE-1), so that no
    engine lands on a training GPU. Yields the GPU count for ray.init (None: Ray's own view)."""
    if not (local_cluster and torch.cuda.is_available()):
        yield None
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    free = devices[int(os.environ.get("LOCAL_WORLD_SIZE", world)):]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(free)  # what the raylet starts with
    try:
        yield len(free)
    finally:
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible


@contextlib.contextmanager
def _engine_devices(layout: EngineLayout):
    """On GPU, the engine's processes see the devices of its group's ranks; on CPU nothing changes."""
    if not torch.cuda.is_available():
        yield
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = engine_visible_devices(visible, torch.cuda.device_count(),
                                                                torch.cuda.current_device(), layout.rollout_tp)
    try:
        yield
    finally:
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible


def engine_visible_devices(visible: str | None, device_count: int, device: int, rollout_tp: int) -> str:
    """CUDA_VISIBLE_DEVICES of a colocated engine owned by the rank on `device` (its index among
    the `visible` ones, as init_distributed set it from the launcher's local rank): that device and
    the next rollout_tp - 1, those of the group's other ranks (a node's ranks are numbered in
    order). Not LOCAL_RANK, which srun and mpirun do not set, nor the global rank, which is past
    the node's devices on a second node; with one GPU per task (srun --gpus-per-task=1) a group
    of several ranks has no devices in common, and is refused."""
    devices = visible.split(",") if visible else [str(index) for index in range(device_count)]
    group = devices[device:device + rollout_tp]
    if len(group) < rollout_tp:
        raise ValueError(f"rollout.tp={rollout_tp}: a colocated engine runs on the devices of its {rollout_tp} ranks, "
                         f"but this rank (device {device}) sees only {len(devices)} GPU(s) ({','.join(devices)}), "
                         "as with one GPU per task (srun --gpus-per-task=1); give every task its node's GPUs "
                         "(--gpus-per-node), or set rollout.tp=1")
    return ",".join(group)

"""One entry to start a rank: process group (NCCL on GPU, gloo on CPU), megatron parallel state, seeds.

Also `spawn_local_workers`, which starts N local ranks itself (CPU, gloo) for commands
run outside a launcher (`rlf-convert`, tests).
"""
from __future__ import annotations

import math
import os
import random
import signal
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from rlfactory_megatron.runtime.cpu_compat import cuda_available, enable_cpu_compat
from rlfactory_megatron.runtime.launch_env import LaunchEnv, detect_launch_env
from rlfactory_megatron.runtime.stop import forward_stop_signals

_own_stores: list = []  # the store a process started by hand hosts for itself, alive with its group


@dataclass(frozen=True)
class ParallelSizes:
    tp: int = 1
    pp: int = 1
    vpp: int | None = None  # virtual pipeline stages per rank (interleaved schedule)
    cp: int = 1  # context-parallel ranks, among which every sequence's tokens are split
    ep: int = 1  # expert-parallel ranks, among which a MoE layer's experts are split (within etp x ep x pp)
    etp: int | None = None  # expert tensor-parallel ranks, which split each expert; None: tp (megatron's default)

    @classmethod
    def of(cls, parallel) -> "ParallelSizes":
        """The sizes a config's `parallel` section names."""
        return cls(parallel.tp, parallel.pp, parallel.vpp, parallel.cp, parallel.ep, parallel.etp)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def model_ranks(self) -> int:
        """Ranks that hold one copy of the model between them (tp x pp x cp): the world is a multiple."""
        return self.tp * self.pp * self.cp

    @property
    def smallest_world(self) -> int:
        """The fewest ranks holding the model and its expert layout (etp x ep x pp ranks per expert
        group, expert parallelism within data parallelism): the ranks rlf-train starts by hand."""
        return math.lcm(self.model_ranks, self.expert_tp * self.ep * self.pp)

    def dp(self, world_size: int) -> int:
        return world_size // self.model_ranks


def init_distributed(
    sizes: ParallelSizes,
    seed: int = 1234,
    launch: LaunchEnv | None = None,
    timeout_s: int = 1800,
) -> LaunchEnv:
    """Initialize torch.distributed and megatron-core model parallelism for (tp, cp, pp, dp)."""
    from megatron.core import parallel_state, tensor_parallel

    launch = launch or detect_launch_env()
    world = launch.world_size
    if world % sizes.model_ranks != 0:
        raise ValueError(
            f"world size {world} is not divisible by parallel.tp*parallel.pp*parallel.cp = "
            f"{sizes.tp}*{sizes.pp}*{sizes.cp}; change parallel.tp/parallel.pp/parallel.cp or the number of processes"
        )
    if world % (sizes.expert_tp * sizes.ep * sizes.pp) != 0:
        raise ValueError(
            f"world size {world} is not divisible by parallel.etp*parallel.ep*parallel.pp = "
            f"{sizes.expert_tp}*{sizes.ep}*{sizes.pp} (megatron's expert groups); change parallel.ep/etp or the "
            "number of processes"
        )
    on_gpu = cuda_available()
    if on_gpu:
        torch.cuda.set_device(local_device_index(launch, torch.cuda.device_count()))
    else:
        enable_cpu_compat()
    if not dist.is_initialized():
        store = _rendezvous_store(launch)
        meeting = {"store": store} if store is not None else {
            "init_method": f"tcp://{launch.master_addr}:{launch.master_port}"}
        dist.init_process_group(
            # On GPU, NCCL for device tensors and gloo for host ones (the trainer's small CPU
            # reductions: plan shapes, metrics, log-prob gathers) on every group megatron makes.
            backend="cpu:gloo,cuda:nccl" if on_gpu else "gloo",
            rank=launch.rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
            **meeting,
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=sizes.tp,
            pipeline_model_parallel_size=sizes.pp,
            virtual_pipeline_model_parallel_size=sizes.vpp,
            context_parallel_size=sizes.cp,
            expert_model_parallel_size=sizes.ep,
            expert_tensor_parallel_size=sizes.etp,
        )
    seed_everything(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return launch


def local_device_index(launch: LaunchEnv, device_count: int) -> int:
    """This rank's CUDA device among those it sees: its local rank's, and 0 when every task sees
    only its own GPU (srun --gpus-per-task=1, local rank > 0)."""
    return launch.local_rank % device_count


def host_rendezvous_store(world_size: int) -> dist.TCPStore:
    """A rendezvous store listening on a port the OS assigns as it binds: a port picked free and
    bound later can be taken in between by any process on the host (EADDRINUSE, seen in CI with
    tests running in parallel)."""
    return dist.TCPStore("127.0.0.1", 0, world_size=world_size, is_master=True, wait_for_workers=False)


def _rendezvous_store(launch: LaunchEnv) -> dist.Store | None:
    """A process started by hand, the only rank, hosts its own store; ranks a launcher started
    meet at its address (None)."""
    if launch.launcher != "single":
        return None
    _own_stores[:] = [host_rendezvous_store(1)]
    return _own_stores[0]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    _own_stores.clear()


def _worker_entry(rank: int, world_size: int, port: int, environ: dict[str, str], fn: Callable[..., Any],
                  args: tuple, results) -> None:
    # The starting process's variables as they are now: a fork server started for an earlier
    # call holds those of its own start.
    os.environ.clear()
    os.environ.update(environ)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # torch loaded in the server read it then
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        # As under torchrun, whose agent hosts the store: every rank connects to it as a client.
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results[rank] = fn(*args)


# What every rank imports first; a CPU host's fork server imports it once for all the ranks it starts.
_RANK_PRELOAD = ["torch", "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer", "transformers"]


def _start_method() -> str:
    """How local ranks start. On a CPU host they fork from a server that imported torch and
    megatron once (each rank's own imports took ~8 CPU-s, most of a small rank's work, and a
    test process starts hundreds); a fresh process's state otherwise, as spawn gives. With a GPU,
    spawn: a process forked after CUDA's libraries initialized cannot use CUDA, and the imports
    are little beside a GPU run."""
    if cuda_available():
        return "spawn"
    import multiprocessing

    multiprocessing.get_context("forkserver").set_forkserver_preload(_RANK_PRELOAD)
    return "forkserver"


def spawn_local_workers(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run `fn(*args)` in `world_size` new local processes (`_start_method`) with torchrun-style env; returns per-rank results.

    For commands started outside a launcher on a single host. `fn` must be importable (module level).
    """
    import torch.multiprocessing as mp

    # The parent hosts the ranks' store (as torchrun's agent does) on a port bound as it is picked.
    store = host_rendezvous_store(world_size)
    port = store.port
    with mp.Manager() as manager:
        results = manager.dict()
        ranks = mp.start_processes(
            _worker_entry,
            args=(world_size, port, dict(os.environ), fn, args, results),
            nprocs=world_size,
            join=False,
            start_method=_start_method(),
        )
        # A stop signal sent to this process alone (`kill <pid>`) reaches the ranks, which stop together.
        previous = forward_stop_signals(ranks.processes)
        try:
            while not ranks.join():
                pass
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return [results[r] for r in range(world_size)]


def run_as_job(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Under a launcher this process is one rank: run `fn` here. Started by hand: run `world_size`
    local ranks (in this process when 1). Returns the per-rank results known to this process."""
    launch = detect_launch_env()
    if launch.launcher != "single":
        if launch.world_size % world_size:
            raise ValueError(f"launcher world size {launch.world_size} is not a multiple of the {world_size} ranks "
                             "one model copy needs (tp*pp, times cp for training)")
        return [fn(*args)]
    if world_size == 1:
        return [fn(*args)]  # this process is the rank; it hosts its own store (init_distributed)
    from torch.multiprocessing import ProcessRaisedException

    try:
        return spawn_local_workers(fn, world_size, *args)
    except ProcessRaisedException as exc:
        # Surface the worker's own error (its last traceback line) as this command's error.
        raise ValueError(str(exc).strip().splitlines()[-1].split(": ", 1)[-1]) from None

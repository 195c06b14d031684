"""This process's rank and the world size, from MPI (mpirun/srun) or torch.distributed (torchrun), and the
one collective the cache needs (allgather)."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

# Launcher environment variables that announce the world size, with the launcher they belong to.
# torchrun first: one torchrun per node under srun also carries srun's (per-node) task count.
LAUNCHER_WORLD_VARS = (
    ("WORLD_SIZE", "torchrun"),
    ("OMPI_COMM_WORLD_SIZE", "Open MPI mpirun"),
    ("PMI_SIZE", "MPICH/Hydra mpiexec"),
    ("PMIX_SIZE", "PMIx launcher"),
    ("SLURM_STEP_NUM_TASKS", "srun"),
)


class LauncherMismatchError(RuntimeError):
    """The launcher started N processes but the communication library sees a different world."""


@dataclass(frozen=True)
class Topology:
    """This process's rank, the world size, and how to gather one object from every rank."""

    rank: int
    world: int
    backend: str  # "mpi", "torch" or "single"
    allgather: Callable[[Any], list[Any]]


def launcher_world(env: Mapping[str, str] | None = None) -> tuple[int, str] | None:
    """The world size a launcher announced in `env` (default: this process's), with the launcher's name;
    None when no launcher did."""
    env = os.environ if env is None else env
    for var, launcher in LAUNCHER_WORLD_VARS:
        if env.get(var, "").isdigit():
            return int(env[var]), launcher
    return None


def single_process() -> Topology:
    return Topology(rank=0, world=1, backend="single", allgather=lambda obj: [obj])


def detect_topology() -> Topology:
    """torch.distributed when it is initialized, else MPI under an MPI launcher, else one process.

    Refuses a launcher/MPI mismatch (e.g. Open MPI's mpirun driving a pip mpich mpi4py): every rank would
    believe it is rank 0 of 1 and all of them would write the same shard.
    """
    torch_topology = _torch_topology()
    if torch_topology is not None:
        return torch_topology
    announced = launcher_world()
    if announced is None or announced[0] <= 1:
        return single_process()
    world, launcher = announced
    if launcher == "torchrun":
        raise LauncherMismatchError(
            f"torchrun announced WORLD_SIZE={world} but torch.distributed is not initialized: "
            "call torch.distributed.init_process_group() before opening the cache"
        )
    comm = _mpi_world()
    if comm is None:
        raise LauncherMismatchError(
            f"{launcher} announced {world} processes but mpi4py is not installed: install mpi4py built for that MPI"
        )
    if comm.Get_size() != world:
        raise LauncherMismatchError(
            f"{launcher} announced {world} processes but MPI_COMM_WORLD has {comm.Get_size()}: mpi4py is linked "
            "to a different MPI than the launcher; start the job with that MPI's own mpiexec (or srun --mpi=pmix)"
        )
    return Topology(rank=comm.Get_rank(), world=comm.Get_size(), backend="mpi", allgather=comm.allgather)


def _torch_topology() -> Topology | None:
    # Looked up, not imported: if the program never imported torch, no process group can exist.
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None

    def allgather(obj: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    return Topology(rank=dist.get_rank(), world=dist.get_world_size(), backend="torch", allgather=allgather)


def _mpi_world():
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.COMM_WORLD

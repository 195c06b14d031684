"""Who am I in the job: rank, world size, local rank and rendezvous address from torchrun, srun or MPI."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchEnv:
    launcher: str  # "torchrun" | "slurm" | "mpi" | "single"
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    local_world_size: int = 1  # ranks of this job on this node


# This process as the only rank, whatever launcher started it (the benchmarks measure one process).
ALONE = LaunchEnv("single", 0, 1, 0, "127.0.0.1", 0)


# Order matters: torchrun inside an sbatch job also sees SLURM_* variables, and
# srun --mpi=pmix sets both SLURM_* and PMIX_*; the most specific launcher wins.
_LAUNCHERS: tuple[tuple[str, str, str, str, str], ...] = (
    # (name, rank var, world var, local-rank var, ranks-on-this-node var)
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("mpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mpi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("mpi", "PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)


def _first_slurm_host(env) -> str | None:
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return None
    # "gpu[12-13,20],cpu1" -> "gpu12"; the sbatch templates export MASTER_ADDR, this is the fallback.
    match = re.match(r"([^\[,]+)(?:\[(\d+))?", nodelist)
    return match.group(1) + (match.group(2) or "")


def _slurm_tasks_here(env) -> str | None:
    """This node's task count from SLURM_TASKS_PER_NODE ("2(x3),1": 2 on nodes 0-2, 1 on node 3),
    by SLURM_NODEID (the node's index in the step)."""
    counts = []
    for part in filter(None, env.get("SLURM_TASKS_PER_NODE", "").split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            return None
        counts += [match.group(1)] * int(match.group(2) or 1)
    node = int(env.get("SLURM_NODEID", 0))
    return counts[node] if node < len(counts) else None


def detect_launch_env(environ: dict[str, str] | None = None) -> LaunchEnv:
    """Read the launcher's environment; a process started by hand is rank 0 of 1."""
    env = os.environ if environ is None else environ
    for name, rank_var, world_var, local_var, local_size_var in _LAUNCHERS:
        if rank_var in env and world_var in env:
            rank, world = int(env[rank_var]), int(env[world_var])
            local = int(env.get(local_var, env.get("LOCAL_RANK", rank)))
            if name == "slurm" and world == 1 and "SLURM_STEP_ID" not in env:
                break  # inside an sbatch allocation but not in an srun step: a plain process
            addr = env.get("MASTER_ADDR") or (_first_slurm_host(env) if name == "slurm" else None) or "127.0.0.1"
            port = int(env.get("MASTER_PORT", 29500))
            local_size = env.get(local_size_var) or (_slurm_tasks_here(env) if name == "slurm" else None)
            return LaunchEnv(name, rank, world, local, addr, port, int(local_size or world))
    return LaunchEnv("single", 0, 1, 0, env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 0) or 0))

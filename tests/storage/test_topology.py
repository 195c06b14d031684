"""Rank/world detection: one process, launcher variables, and refusing a launcher that MPI does not agree with."""
from __future__ import annotations

import subprocess
import sys

import pytest

from rlfactory_megatron.envs.storage.topology import (LAUNCHER_WORLD_VARS, LauncherMismatchError, detect_topology,
                                                      launcher_world)


def test_launcher_world_reads_each_launcher():
    assert launcher_world({}) is None
    assert launcher_world({"OMPI_COMM_WORLD_SIZE": "8"}) == (8, "Open MPI mpirun")
    assert launcher_world({"PMI_SIZE": "4", "PMI_RANK": "1"}) == (4, "MPICH/Hydra mpiexec")
    assert launcher_world({"SLURM_STEP_NUM_TASKS": "16"}) == (16, "srun")
    assert launcher_world({"WORLD_SIZE": "2", "SLURM_STEP_NUM_TASKS": "1"}) == (2, "torchrun")


@pytest.fixture
def no_launcher(monkeypatch):
    for var, _ in LAUNCHER_WORLD_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_no_launcher_is_a_single_process(no_launcher):
    topology = detect_topology()
    assert (topology.rank, topology.world, topology.backend) == (0, 1, "single")
    assert topology.allgather("x") == ["x"]


def test_torchrun_without_process_group_is_refused(no_launcher):
    no_launcher.setenv("WORLD_SIZE", "4")
    with pytest.raises(LauncherMismatchError, match="init_process_group"):
        detect_topology()


def test_mpi_launcher_with_another_mpi_is_refused(subprocess_env):
    """Open MPI's mpirun announcing 4 ranks to a pip-mpich mpi4py, which sees a world of 1."""
    code = "from rlfactory_megatron.envs.storage import detect_topology; detect_topology()"
    proc = subprocess.run([sys.executable, "-c", code], env={**subprocess_env, "OMPI_COMM_WORLD_SIZE": "4"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "LauncherMismatchError: Open MPI mpirun announced 4 processes but MPI_COMM_WORLD has 1" in proc.stderr

"""Rank/world/address come from whichever launcher started the process."""
import pytest

from rlfactory_megatron.runtime.launch_env import detect_launch_env


@pytest.mark.parametrize("env,expected", [
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node7", "MASTER_PORT": "29400"},
     ("torchrun", 3, 8, 1, "node7", 29400)),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
      "SLURM_STEP_NODELIST": "gpu[12-13],gpu20", "MASTER_PORT": "12345"},
     ("slurm", 5, 16, 1, "gpu12", 12345)),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2"},
     ("mpi", 2, 4, 2, "127.0.0.1", 29500)),
    ({"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MASTER_ADDR": "10.0.0.1"},
     ("mpi", 1, 4, 1, "10.0.0.1", 29500)),
    # torchrun inside an sbatch step: torchrun's variables win over Slurm's.
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0"},
     ("torchrun", 1, 2, 1, "127.0.0.1", 29500)),
    # A plain process inside an sbatch allocation (no srun step) is a single process.
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n1"}, ("single", 0, 1, 0, "127.0.0.1", 0)),
    ({}, ("single", 0, 1, 0, "127.0.0.1", 0)),
])
def test_detect_launch_env(env, expected):
    got = detect_launch_env(env)
    assert (got.launcher, got.rank, got.world_size, got.local_rank, got.master_addr, got.master_port) == expected

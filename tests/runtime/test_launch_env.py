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


@pytest.mark.parametrize("env,ranks_here", [
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, 4),
    ({"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, 2),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 4),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_STEP_ID": "0", "SLURM_TASKS_PER_NODE": "8(x2)"}, 8),
    # an uneven layout: 2 tasks on each of nodes 0-2, 1 on node 3; this node's count by SLURM_NODEID
    ({"SLURM_PROCID": "6", "SLURM_NTASKS": "7", "SLURM_STEP_ID": "0", "SLURM_TASKS_PER_NODE": "2(x3),1",
      "SLURM_NODEID": "3"}, 1),
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "7", "SLURM_STEP_ID": "0", "SLURM_TASKS_PER_NODE": "2(x3),1",
      "SLURM_NODEID": "1"}, 2),
    ({"PMI_RANK": "0", "PMI_SIZE": "2"}, 2),  # not said: every rank on this node
    ({}, 1),
])
def test_ranks_on_this_node(env, ranks_here):
    assert detect_launch_env(env).local_world_size == ranks_here


def test_thread_choice_leaves_a_core_and_yields_to_the_user(monkeypatch):
    from rlfactory_megatron.runtime import threads

    assert [threads.threads_per_rank(cores, 1) for cores in (1, 2, 4, 16)] == [1, 1, 3, 15]
    assert threads.threads_per_rank(16, 8) == 1 and threads.threads_per_rank(64, 8) == 7
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    for var in threads.THREAD_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    line = threads.choose_threads(ranks_on_node=1)
    assert line.startswith("OMP_NUM_THREADS=3 per rank (4 usable cores, 1 rank(s) on this node")
    assert threads.os.environ["OMP_NUM_THREADS"] == "3"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads.choose_threads(ranks_on_node=1) is None and threads.os.environ["OMP_NUM_THREADS"] == "2"


def test_minor_thread_line_is_true_when_ranks_outnumber_cores(monkeypatch):
    # Issue 53 item 12: 16 ranks on 2 cores were "-14 left for tools, rewards and engines".
    from rlfactory_megatron.runtime import threads

    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    for var in threads.THREAD_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    line = threads.choose_threads(ranks_on_node=16)
    assert line.startswith("OMP_NUM_THREADS=1 per rank (2 usable cores, 16 rank(s) on this node, ranks outnumber "
                           "cores)"), line
    assert "-" not in line.split(";")[0], line

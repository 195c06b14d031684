"""Which GPUs a colocated engine's processes see, under every launcher: those of its group's
ranks on their node. CUDA is a stand-in here (device count and current device patched, as
init_distributed sets them from the launcher's environment); the choice itself is the trainer's."""
import os

import pytest
import torch

from rlfactory_megatron.runtime.distributed import local_device_index
from rlfactory_megatron.runtime.launch_env import detect_launch_env
from rlfactory_megatron.rollout.fleet import EngineLayout, _engine_devices

# (launcher environment, the GPUs every task sees, rollout.tp, the engine's CUDA_VISIBLE_DEVICES)
CASES = {
    "torchrun": ({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}, 4, 2, "2,3"),
    # srun, second node of two with 4 tasks each: no LOCAL_RANK, global rank 6 is past the node's GPUs
    "srun, second node": ({"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_STEP_ID": "0",
                           "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 4, 2, "2,3"),
    "mpirun, second node": ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
                             "OMPI_COMM_WORLD_LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 4, 1, "1"),
    # srun --gpus-per-task=1: task 3 sees only its own GPU, physical index 3
    "srun, one GPU per task": ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "3", "SLURM_STEP_ID": "0",
                                "CUDA_VISIBLE_DEVICES": "3"}, 1, 1, "3"),
}


def engine_devices_under(monkeypatch, env: dict, device_count: int, rollout_tp: int) -> str:
    for key in [k for k in os.environ if k.split("_")[0] in ("RANK", "LOCAL", "SLURM", "OMPI", "PMI", "PMIX", "MPI")
                or k in ("WORLD_SIZE", "CUDA_VISIBLE_DEVICES")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    launch = detect_launch_env()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: device_count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: local_device_index(launch, device_count))
    with _engine_devices(EngineLayout(world=launch.world_size, rollout_tp=rollout_tp, rank=launch.rank)):
        seen = os.environ["CUDA_VISIBLE_DEVICES"]
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == env.get("CUDA_VISIBLE_DEVICES")  # put back
    return seen


@pytest.mark.parametrize("launcher", CASES)
def test_item3_engine_sees_its_groups_gpus_under_srun_mpirun_and_per_task_binding(monkeypatch, launcher):
    env, device_count, rollout_tp, expected = CASES[launcher]
    assert engine_devices_under(monkeypatch, env, device_count, rollout_tp) == expected


def test_item3_engine_of_several_ranks_with_one_gpu_per_task_is_refused(monkeypatch):
    env = {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "2", "SLURM_STEP_ID": "0",
           "CUDA_VISIBLE_DEVICES": "2"}
    with pytest.raises(ValueError, match=r"rollout.tp=2: a colocated engine runs on the devices of its 2 ranks, "
                                         r"but this rank \(device 0\) sees only 1 GPU\(s\) \(2\).*--gpus-per-node"):
        engine_devices_under(monkeypatch, env, 1, 2)

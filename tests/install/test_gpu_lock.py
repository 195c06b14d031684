"""The GPU stack installs reproducibly: requirements/gpu.lock is exactly what pip resolves for
Linux x86_64 / CPython 3.12 from the registry, ./install.sh --gpu and the Dockerfile install that
lock and nothing else, and on a machine without a GPU `./install.sh --gpu` stops at once."""
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).parents[2]
import gpu_lock


def test_the_lock_is_what_pip_resolves_for_the_gpu_platform():
    # With the lock as constraints, pip's resolver (against the registry, for the GPU platform)
    # must arrive at exactly the lock: nothing missing, nothing extra, every wheel there.
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_lock.py"), "check"], capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    locked = gpu_lock.read_lock()
    for package, version in (("torch", "2.13.0"), ("megatron-core", "0.16.1"), ("vllm", "0.32.0")):
        assert locked[package] == version  # the CPU stack's versions: one code path on both
    assert {"transformer-engine", "transformer-engine-cu13", "datasets", "wandb"} <= set(locked)
    assert "hydra-core" not in locked


def _te_extension_requirements(version: str) -> list[str]:
    """Requires-Dist of transformer-engine-torch's source distribution, read from the registry."""
    request = urllib.request.Request("https://pypi.org/simple/transformer-engine-torch/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    files = json.load(urllib.request.urlopen(request, timeout=60))["files"]
    sdist = next(f["url"] for f in files if f["filename"] == f"transformer_engine_torch-{version}.tar.gz")
    with tarfile.open(fileobj=io.BytesIO(urllib.request.urlopen(sdist, timeout=120).read())) as archive:
        info = archive.extractfile(f"transformer_engine_torch-{version}/PKG-INFO").read().decode()
    return [line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("Requires-Dist:")]


def test_the_te_extension_built_by_install_sh_needs_only_locked_packages():
    locked = gpu_lock.read_lock()
    for requirement in _te_extension_requirements(locked["transformer-engine"]):
        name = gpu_lock.canonical(re.split(r"[<>=!~; \[]", requirement, maxsplit=1)[0])
        assert name in locked, f"transformer-engine-torch needs {requirement}, which the lock lacks"


def test_install_sh_and_the_dockerfile_install_exactly_the_lock():
    script = (ROOT / "install.sh").read_text()
    gpu_branch = script[script.index('# Exactly the lock'):script.index("pip install -q --no-deps -e .")]
    pip_lines = [line.strip() for line in gpu_branch.splitlines() if line.strip().startswith(("pip ", "NVTE_"))]
    assert pip_lines[0] == "pip install -q --no-deps --only-binary=:all: -r requirements/gpu.lock"
    # then only TE's extension, at the lock's TE version, without its dependencies
    assert '"transformer-engine-torch==$te_version"' in gpu_branch and "--no-deps --no-build-isolation" in gpu_branch
    assert "sed -n 's/^transformer-engine==//p' requirements/gpu.lock" in gpu_branch
    assert len(pip_lines) == 2, pip_lines
    dockerfile = (ROOT / "Dockerfile").read_text()
    base = re.search(r"^FROM (\S+)", dockerfile, re.M).group(1)
    assert re.fullmatch(r"nvidia/cuda:13\.0\.\d+-cudnn-devel-ubuntu24\.04", base), base  # an exact tag
    assert f"python{gpu_lock.PYTHON_VERSION}" in dockerfile  # the Python the lock is resolved for
    runs = [line for line in dockerfile.splitlines() if "install.sh" in line and line.startswith("RUN")]
    assert len(runs) == 1 and runs[0].endswith("./install.sh --gpu") and "pip" not in dockerfile.replace(
        "PIP_NO_CACHE_DIR", "")


def test_install_sh_gpu_without_a_gpu_stops_at_once_and_changes_nothing(tmp_path):
    venv = tmp_path / "venv"
    clock = time.monotonic()
    run = subprocess.run([str(ROOT / "install.sh"), "--gpu"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "RLF_VENV": str(venv)})
    assert run.returncode != 0 and time.monotonic() - clock < 10
    assert run.stdout == "" and len(run.stderr.splitlines()) == 1, run.stderr
    assert "needs an NVIDIA GPU with its CUDA driver" in run.stderr
    assert not venv.exists()


def test_no_cuda_driver_check_in_install_sh_gpu(tmp_path):
    # Issue 53 item 7: a GPU on a driver older than CUDA 13 needs is refused before anything is
    # installed, with the driver found and the one needed; the number is rlf-train's.
    from rlfactory_megatron.runtime.cuda_driver import MIN_DRIVER

    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text('#!/bin/sh\n[ "$1" = -L ] && echo "GPU 0: NVIDIA H100 80GB HBM3" || echo 550.54.15\n')
    smi.chmod(0o755)
    venv = tmp_path / "venv"
    run = subprocess.run([str(ROOT / "install.sh"), "--gpu"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "RLF_VENV": str(venv), "PATH": f"{smi.parent}:{os.environ['PATH']}"})
    assert run.returncode != 0 and run.stdout == "" and len(run.stderr.splitlines()) == 1, run.stderr
    assert f"needs NVIDIA driver >= {MIN_DRIVER}" in run.stderr and "is 550.54.15" in run.stderr, run.stderr
    assert not venv.exists()

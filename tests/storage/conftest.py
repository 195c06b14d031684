"""Fixtures for the HDF5 cache tests: the worker module, a clean subprocess environment, the venv's launchers."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from console_scripts import BIN

HERE = Path(__file__).parent
_LAUNCHER_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_SIZE",
                  "SLURM_STEP_NUM_TASKS", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="session")
def workers():
    """tests/storage/workers.py as a module (pytest's importlib mode does not put it on sys.path)."""
    spec = importlib.util.spec_from_file_location("storage_workers", HERE / "workers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def worker_cmd() -> list[str]:
    return [sys.executable, str(HERE / "workers.py")]


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """This environment minus any launcher's variables, one thread per process (2 shared cores)."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture
def venv_bin() -> Path:
    return BIN

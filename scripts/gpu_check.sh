#!/usr/bin/env bash
# The checks only a GPU can run (NCCL, the Triton log-prob kernel, vLLM sleep mode, weight sync
# into a CUDA engine): one PASS/FAIL line each, a summary line, exit 1 if any failed.
# Needs one CUDA GPU and the GPU stack (./install.sh --gpu); stops after 10 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
exec timeout 600 "${RLF_PYTHON:-.venv/bin/python}" scripts/gpu_check.py "$@"

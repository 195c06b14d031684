#!/usr/bin/env bash
# The checks of a GPU run's path (Transformer-Engine layers in bf16, the Triton log-prob kernel, an
# engine in its own process fed by handles, vLLM sleep mode, rlf-train in bf16 colocated and
# disaggregated over NCCL): one PASS/FAIL/SKIP line each, a summary line, exit 1 if any failed.
# Needs one CUDA GPU and the GPU stack (./install.sh --gpu); stops after 10 minutes.
# --cpu: each check's CPU counterpart, and the list of the GPU-only ones (what the suite runs).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
exec timeout 600 "${RLF_PYTHON:-.venv/bin/python}" scripts/gpu_check.py "$@"

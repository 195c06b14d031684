#!/usr/bin/env bash
# Single-node launcher: scripts/torchrun_local.sh NPROC COMMAND-MODULE [args...]
#   scripts/torchrun_local.sh 4 rlfactory_megatron.cli.convert check --hf-dir H --tp 2 --pp 2
set -euo pipefail
cd "$(dirname "$0")/.."
nproc=$1; module=$2; shift 2
exec .venv/bin/torchrun --standalone --nproc-per-node="$nproc" -m "$module" "$@"

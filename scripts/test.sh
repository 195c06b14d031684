#!/usr/bin/env bash
# The whole test suite (what the README's test command and .ci/run call), or a part of it:
#   scripts/test.sh                              everything
#   scripts/test.sh tests/rewards -k nan         only what is named (paths, node ids), with pytest's options
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Paths or node ids among the arguments select what runs; without any, the whole suite does.
selected=0
for arg in "$@"; do
  case "$arg" in
    tests|tests/*|./tests*) selected=1 ;;
  esac
done
targets=()
[ "$selected" = 1 ] || targets=(tests)
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=900 "${targets[@]}" "$@"

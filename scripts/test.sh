#!/usr/bin/env bash
# The whole test suite (what the README's test command and .ci/run call).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=900 tests "$@"

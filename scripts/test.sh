#!/usr/bin/env bash
# The whole test suite (what the README's test command and .ci/run call), or a part of it:
#   scripts/test.sh                              everything: on RLF_TEST_WORKERS pytest workers (default 2),
#                                                then the tests marked `serial` alone
#   scripts/test.sh tests/rewards -k nan         only what is named (paths, node ids), with pytest's options,
#                                                in this process unless RLF_TEST_WORKERS is set
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider --timeout=900)
# Paths or node ids among the arguments select what runs; without any, the whole suite does.
selected=0
for arg in "$@"; do
  case "$arg" in
    tests|tests/*|./tests*) selected=1 ;;
  esac
done
if [ "$selected" = 1 ]; then
  workers=${RLF_TEST_WORKERS:-0}
  [ "$workers" = 0 ] && exec "${pytest[@]}" "$@"
  exec "${pytest[@]}" -n "$workers" --dist loadgroup "$@"
fi
# Two workers: most tests wait on process start-up and one engine or rank at a time, so one test
# at a time left about half of the 2 cores idle (measured: 53 CPU-min in 60 min). Tests sharing a
# machine-wide resource (the Slurm cluster) are one xdist_group, run by one worker; tests with
# bounds on wall time (marked serial) run alone afterwards, where a second test cannot slow them.
workers=${RLF_TEST_WORKERS:-2}
# The whole suite has a time budget (55 min on the 2-core machine): each run names its slowest
# tests, so what to trim is in every CI log.
slowest=(--durations=25 --durations-min=30)
status=0
if [ "$workers" = 0 ]; then
  "${pytest[@]}" "${slowest[@]}" tests "$@" || status=$?
else
  "${pytest[@]}" "${slowest[@]}" -n "$workers" --dist loadgroup -m "not serial" tests "$@" || status=$?
  "${pytest[@]}" "${slowest[@]}" -m serial tests "$@" || status=$((status ? status : $?))
fi
exit "$status"

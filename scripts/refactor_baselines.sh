#!/usr/bin/env bash
# Issue 43's acceptance runs, for comparing a refactor bit for bit with the code before it:
#   scripts/refactor_baselines.sh OUT             the embedded default (5 RL steps), a 2-rank colocated
#                                                 run and a disaggregated run (3 steps each) into OUT
#   scripts/refactor_baselines.sh OUT BASELINE    the same, then compares OUT with BASELINE's runs
# Sizes are the tests' scale-to-CPU keys (tests/trainer/rlf_train_cli.py SMALL); each run's SFT
# warm-start is computed by the first run and reused from OUT/warm-starts by the others.
set -euo pipefail
root=$(realpath "$(dirname "$0")/..")
out=$(realpath -m "$1")
mkdir -p "$out"
cd "$out"  # not the worktree: `python -m` would import the package from the working directory
bin=$root/.venv/bin
read -r -a small < <("$bin/python" -c "import sys; sys.path[:0] = ['$root/tests/common', '$root/tests/trainer']; from rlf_train_cli import SMALL; print(*SMALL)")
export OMP_NUM_THREADS=1 RLF_DEVICE_DISCIPLINE=1 RLF_CACHE_HOME=$out/rlf-cache
unset RANK WORLD_SIZE LOCAL_RANK RAY_ADDRESS
common=("${small[@]}" "trainer.seed=1234" "trainer.sft_cache=$out/warm-starts")
run() {  # run NAME COMMAND... : one run into OUT/NAME, its output in OUT/NAME.log
  local name=$1; shift
  rm -rf "${out:?}/$name"
  echo "$name: $*" >&2
  "$@" "${common[@]}" "trainer.output_dir=$out/$name" >"$out/$name.log" 2>&1 || { tail -30 "$out/$name.log"; exit 1; }
}
run default "$bin/rlf-train" trainer.total_steps=5
run colocated_dp2 "$bin/torchrun" --standalone --nproc-per-node 2 -m rlfactory_megatron.cli.train trainer.total_steps=3
run disaggregated "$bin/rlf-train" trainer.total_steps=3 rollout.mode=disaggregated rollout.num_engines=2
if [ $# -ge 2 ]; then
  "$bin/python" "$root/scripts/refactor_baselines_compare.py" "$out" "$(realpath "$2")"
fi

#!/usr/bin/env bash
# Qwen3-8B, DAPO-style GRPO with tools on MATH, 2 nodes x 8 GPUs (tp=4 pp=2 dp=2).
# With Slurm (Ray head/worker and torchrun on each node come from the sbatch script):
#   MODEL=/models/Qwen3-8B DATA=~/data/math sbatch --nodes=2 examples/grpo_qwen3_8b_2node.sh
# Without Slurm, on each node (NODE_RANK 0 and 1, MASTER_ADDR = node 0's address):
#   MODEL=... DATA=... examples/grpo_qwen3_8b_2node.sh NODE_RANK 2 MASTER_ADDR
# DATA is written once from the Hugging Face hub (MATH_SOURCE=<folder>: from a local copy of it).
# The job's log is <job name>-<job id>.out in the folder sbatch ran in (Slurm opens it before the
# script runs, and creates no folder for it). 15 minutes before the time limit (sbatch --time; a step of this model and its checkpoint take minutes)
# Slurm sends SIGUSR1 to the job's steps, where the ranks run: they end their step, save a
# checkpoint and exit; the same sbatch command resumes (docs/launchers.md). Not B:USR1: that
# would go to this batch shell alone, which would die of it and leave the ranks unsignalled.
#SBATCH --job-name=rlf-qwen3-8b
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
#SBATCH --signal=USR1@900
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
MODEL=${MODEL:-/models/Qwen3-8B}
DATA=${DATA:-$HOME/data/math}
.venv/bin/python examples/data_preprocess/math_dataset.py ${MATH_SOURCE:+--source "$MATH_SOURCE"} --out "$DATA"
args=(--config rlfactory_megatron/config/examples/qwen3_8b_grpo_2node.yaml model.path="$MODEL"
      trainer.data_path="$DATA/train.parquet" trainer.val_data_path="$DATA/test.parquet")
exec scripts/launch_example_nodes.sh "$0" "${args[@]}" -- "$@"

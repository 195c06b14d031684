#!/usr/bin/env bash
# Qwen2.5-7B-Instruct, GRPO with the calculator tool on GSM8K, one node of 8 GPUs (80 GB class).
#   MODEL=/models/Qwen2.5-7B-Instruct DATA=~/data/gsm8k examples/grpo_qwen2_5_7b_gsm8k_tools.sh [overrides...]
# Extra arguments are rlf-train overrides, e.g. trainer.total_steps=100 actor.optim.lr=5e-7.
# DATA is written once from the Hugging Face hub (GSM8K_SOURCE=<folder>: from a local copy of it).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-/models/Qwen2.5-7B-Instruct}
DATA=${DATA:-$HOME/data/gsm8k}
.venv/bin/python examples/data_preprocess/gsm8k.py ${GSM8K_SOURCE:+--source "$GSM8K_SOURCE"} --out "$DATA"
exec .venv/bin/torchrun --standalone --nproc-per-node="${GPUS:-8}" -m rlfactory_megatron.cli.train \
  --config rlfactory_megatron/config/examples/qwen2_5_7b_grpo_8gpu.yaml \
  model.path="$MODEL" trainer.data_path="$DATA/train.parquet" trainer.val_data_path="$DATA/test.parquet" "$@"

#!/usr/bin/env bash
# Llama-3.1-8B-Instruct, GRPO with the calculator tool (Llama 3 JSON tool calls) on GSM8K, 8 GPUs.
#   MODEL=/models/Llama-3.1-8B-Instruct DATA=~/data/gsm8k examples/grpo_llama3_1_8b_gsm8k_tools.sh [overrides...]
# DATA is written once from the Hugging Face hub (GSM8K_SOURCE=<folder>: from a local copy of it).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-/models/Llama-3.1-8B-Instruct}
DATA=${DATA:-$HOME/data/gsm8k}
.venv/bin/python examples/data_preprocess/gsm8k.py ${GSM8K_SOURCE:+--source "$GSM8K_SOURCE"} --out "$DATA"
exec .venv/bin/torchrun --standalone --nproc-per-node="${GPUS:-8}" -m rlfactory_megatron.cli.train \
  --config rlfactory_megatron/config/examples/llama3_1_8b_grpo_8gpu.yaml \
  model.path="$MODEL" trainer.data_path="$DATA/train.parquet" trainer.val_data_path="$DATA/test.parquet" "$@"

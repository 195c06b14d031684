#!/usr/bin/env bash
# Qwen2-7B-Instruct, PPO with a critic on GSM8K + MATH, Megatron tp=2 pp=2 dp=2 on 8 GPUs.
#   MODEL=/models/Qwen2-7B-Instruct DATA=~/data examples/ppo_trainer/run_qwen2-7b_math_gsm8k_megatron.sh [overrides...]
# The two datasets are preprocessed (once) and joined into one training and one test file; each
# row's data_source picks its scorer (reward.scorer=null in the config). They come from the Hugging
# Face hub (GSM8K_SOURCE, MATH_SOURCE=<folder>: from local copies).
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${MODEL:-/models/Qwen2-7B-Instruct}
DATA=${DATA:-$HOME/data}
.venv/bin/python examples/data_preprocess/gsm8k.py ${GSM8K_SOURCE:+--source "$GSM8K_SOURCE"} --out "$DATA/gsm8k"
.venv/bin/python examples/data_preprocess/math_dataset.py ${MATH_SOURCE:+--source "$MATH_SOURCE"} --out "$DATA/math"
for split in train test; do
  .venv/bin/python - "$DATA" "$split" <<'PY'
import sys, pyarrow as pa, pyarrow.parquet as pq
data, split = sys.argv[1:]
tables = [pq.read_table(f"{data}/{name}/{split}.parquet") for name in ("gsm8k", "math")]
pq.write_table(pa.concat_tables(tables, promote_options="permissive"), f"{data}/gsm8k_math_{split}.parquet")
PY
done
exec .venv/bin/torchrun --standalone --nproc-per-node="${GPUS:-8}" -m rlfactory_megatron.cli.train \
  --config rlfactory_megatron/config/examples/qwen2_7b_ppo_megatron.yaml \
  model.path="$MODEL" trainer.data_path="$DATA/gsm8k_math_train.parquet" \
  trainer.val_data_path="$DATA/gsm8k_math_test.parquet" "$@"

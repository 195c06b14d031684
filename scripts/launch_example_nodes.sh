#!/usr/bin/env bash
# The launch of a multi-node example: sbatch'ed, slurm/train.sbatch runs it (Ray and torchrun on
# each node); otherwise NODE_RANK NNODES MASTER_ADDR lead the user's arguments and
# scripts/launch_multinode.sh runs this node's ranks (RLF_NPROC_PER_NODE=${GPUS:-8}).
#   scripts/launch_example_nodes.sh EXAMPLE [rlf-train args...] -- [NODE_RANK NNODES MASTER_ADDR] [overrides...]
set -euo pipefail
example=$1; shift
args=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do args+=("$1"); shift; done
[ $# -gt 0 ] && shift
if [ -n "${SLURM_JOB_ID:-}" ]; then
  exec bash slurm/train.sbatch "${args[@]}" "$@"
fi
[ $# -ge 3 ] || { echo "usage: $example NODE_RANK NNODES MASTER_ADDR [overrides...] (or sbatch it)" >&2; exit 2; }
node_rank=$1 nnodes=$2 master=$3; shift 3
RLF_NPROC_PER_NODE=${GPUS:-8} exec "$(dirname "$0")/launch_multinode.sh" "$node_rank" "$nnodes" "$master" -- "${args[@]}" "$@"

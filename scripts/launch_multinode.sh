#!/usr/bin/env bash
# Multi-node rlf-train without Slurm: run this once on every node, same NNODES and MASTER_ADDR.
#   scripts/launch_multinode.sh NODE_RANK NNODES MASTER_ADDR -- [rlf-train args...]
#   node 0:  scripts/launch_multinode.sh 0 2 10.0.0.1 -- --config my_run.yaml
#   node 1:  scripts/launch_multinode.sh 1 2 10.0.0.1 -- --config my_run.yaml
# Ranks per node: RLF_NPROC_PER_NODE (default: the node's GPUs, 1 on a CPU node). Rendezvous:
# torchrun's static rendezvous on MASTER_ADDR:MASTER_PORT (default 29400), hosted by node 0's
# first rank, so node NODE_RANK holds global ranks NODE_RANK*nproc ... NODE_RANK*nproc+nproc-1:
# parallel.tp (and rollout.tp) <= ranks per node keeps TP within a node, data parallelism goes
# across nodes. Ray (tools, rewards, disaggregated engines) is started by
# rank 0 on its node unless RAY_ADDRESS names a running cluster.
set -euo pipefail
usage="usage: $0 NODE_RANK NNODES MASTER_ADDR -- [rlf-train args...]"
[ $# -ge 3 ] || { echo "$usage" >&2; exit 2; }
node_rank=$1; nnodes=$2; master_addr=$3; shift 3
[ "${1:-}" = "--" ] && shift
[[ "$node_rank" =~ ^[0-9]+$ && "$nnodes" =~ ^[0-9]+$ && "$node_rank" -lt "$nnodes" ]] \
  || { echo "launch_multinode: NODE_RANK ($node_rank) must be in [0, NNODES=$nnodes); $usage" >&2; exit 2; }

repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${RLF_VENV:-$repo/.venv}
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
nproc=${RLF_NPROC_PER_NODE:-$([ "${gpus:-0}" -gt 0 ] && echo "$gpus" || echo 1)}
port=${MASTER_PORT:-29400}

echo "launch_multinode: node $node_rank of $nnodes, $nproc rank(s) here, rendezvous $master_addr:$port" >&2
exec "$venv/bin/torchrun" \
  --nnodes="$nnodes" --node-rank="$node_rank" --nproc-per-node="$nproc" \
  --master-addr="$master_addr" --master-port="$port" \
  -m rlfactory_megatron.cli.train "$@"

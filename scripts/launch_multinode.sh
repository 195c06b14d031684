#!/usr/bin/env bash
# Multi-node rlf-train without Slurm: run this once on every node, same NNODES and MASTER_ADDR.
#   scripts/launch_multinode.sh NODE_RANK NNODES MASTER_ADDR -- [rlf-train args...]
#   node 0:  scripts/launch_multinode.sh 0 2 10.0.0.1 -- --config my_run.yaml
#   node 1:  scripts/launch_multinode.sh 1 2 10.0.0.1 -- --config my_run.yaml
# Ranks per node: RLF_NPROC_PER_NODE (default: the node's GPUs, 1 on a CPU node). Rendezvous:
# torchrun's static rendezvous on MASTER_ADDR:MASTER_PORT (default 29400), hosted by node 0's
# first rank, so node NODE_RANK holds global ranks NODE_RANK*nproc ... NODE_RANK*nproc+nproc-1:
# parallel.tp (and rollout.tp) <= ranks per node keeps TP within a node, data parallelism goes
# across nodes. Ray (tools, rewards, engines): one cluster for the job, one Ray per node, as
# slurm/train.sbatch starts it: the head on node 0 at MASTER_ADDR:RAY_PORT (default MASTER_PORT+1),
# a worker on every other node (each node's engine processes join their own host's Ray), each
# stopped when its node's ranks end; with RAY_ADDRESS set, that running cluster instead. Give
# every node the same RAY_AUTH_TOKEN to turn on Ray's token authentication.
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

ray_pid=
if [ -z "${RAY_ADDRESS:-}" ]; then
  export RAY_ADDRESS="$master_addr:${RAY_PORT:-$((port + 1))}"
  # Ray's token authentication (on by default since Ray 2.59) needs one token on every node: with
  # RAY_AUTH_TOKEN given to each, it is on; without, it is off (each node would make its own).
  if [ -n "${RAY_AUTH_TOKEN:-}" ]; then export RAY_AUTH_MODE=token; else export RAY_AUTH_MODE=disabled; fi
  # Ray's GPUs: those after the ranks' (as slurm/train.sbatch gives them).
  ray_gpus=$(( ${gpus:-0} > nproc ? gpus - nproc : 0 ))
  ray_devices=$( ((ray_gpus > 0)) && seq -s, "$nproc" $((gpus - 1)) || true)
  ray_here=(env CUDA_VISIBLE_DEVICES="$ray_devices" "$venv/bin/ray" start --num-gpus="$ray_gpus" --block
            --disable-usage-stats)
  head_up() { "$venv/bin/ray" status --address="$RAY_ADDRESS" >/dev/null 2>&1; }
  # Stopping a `ray start --block` stops this node's Ray, and only this job's (`ray stop` would
  # stop every Ray of the host).
  stop_ray() { [ -z "$ray_pid" ] || { kill "$ray_pid" 2>/dev/null || true; wait "$ray_pid" 2>/dev/null || true; }; }
  trap stop_ray EXIT
  if [ "$node_rank" = 0 ]; then
    "${ray_here[@]}" --head --node-ip-address="$master_addr" --port="${RAY_ADDRESS##*:}" --include-dashboard=false &
    ray_pid=$!
  fi
  up=0
  for _ in $(seq 90); do
    head_up && { up=1; break; }
    [ -z "$ray_pid" ] || kill -0 "$ray_pid" 2>/dev/null || break  # the head ended: it will not come up
    sleep 2
  done
  if [ "$up" != 1 ]; then
    echo "launch_multinode: no Ray head at $RAY_ADDRESS (node 0 starts it; its error is above); set RAY_PORT to a free port outside Ray's worker ports (10002-19999)" >&2
    exit 1
  fi
  if [ "$node_rank" != 0 ]; then
    "${ray_here[@]}" --address="$RAY_ADDRESS" &
    ray_pid=$!
  fi
fi
status=0
"$venv/bin/torchrun" \
  --nnodes="$nnodes" --node-rank="$node_rank" --nproc-per-node="$nproc" \
  --master-addr="$master_addr" --master-port="$port" \
  -m rlfactory_megatron.cli.train "$@" || status=$?
exit $status

"""slurm/train.sbatch's split of each node's GPUs between the Megatron ranks and Ray (the
disaggregated engines), read off a dry run: the real template under bash, with `srun`,
`scontrol`, `ray` and `torchrun` replaced by stand-ins that record how they were called (no
scheduler, no GPU: tests/slurm/test_sbatch.py runs the template on a real Slurm)."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

STANDINS = {
    # srun [options] command...: runs the command (the node from -w in SRUN_NODE)
    "srun": 'node=""\nwhile [[ $# -gt 0 && $1 == -* ]]; do [[ $1 == -w ]] && { node=$2; shift; }; shift; done\n'
            'SRUN_NODE=$node exec "$@"',
    "scontrol": 'echo g1; echo g2',
    "venv/ray": '[[ $1 == status ]] && exit 0\necho "ray node=$SRUN_NODE CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES $*" >> "$CALLS"',
    # The Ray worker's step runs in the background and the script stops it on exit: torchrun (the
    # script's last step) waits until both nodes' Ray calls are recorded, so the record is whole.
    "venv/torchrun": 'for _ in $(seq 600); do [ "$(grep -c "^ray " "$CALLS" 2>/dev/null)" -ge 2 ] && break; sleep 0.1; done\n'
                     'echo "torchrun CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset} $*" >> "$CALLS"',
}


def dry_run(tmp_path: Path, node_gpus: int, ranks_per_node: int | None) -> tuple[int, str, list[str]]:
    bin_dir, venv = tmp_path / "bin", tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    bin_dir.mkdir(exist_ok=True)
    for name, body in STANDINS.items():
        path = (venv / "bin" / name.split("/")[1]) if name.startswith("venv/") else bin_dir / name
        path.write_text("#!/usr/bin/env bash\n" + body + "\n")
        path.chmod(0o755)
    python = venv / "bin" / "python"
    if not python.exists():
        python.symlink_to(sys.executable)
    calls = tmp_path / "calls.log"
    calls.unlink(missing_ok=True)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path), "CALLS": str(calls),
           "RLF_VENV": str(venv), "RLF_REPO": str(REPO), "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "g[1-2]",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": str(node_gpus), "MASTER_PORT": "29611"}
    if ranks_per_node is not None:
        env["RLF_GPUS_PER_NODE"] = str(ranks_per_node)
    done = subprocess.run(["bash", str(REPO / "slurm" / "train.sbatch"), "rollout.mode=disaggregated"],
                          capture_output=True, text=True, env=env, timeout=60)
    return done.returncode, done.stdout + done.stderr, sorted(calls.read_text().splitlines()) if calls.exists() else []


def test_item4_train_sbatch_gives_ray_the_gpus_its_ranks_leave(tmp_path):
    # 8-GPU nodes, 6 ranks each: the engines' Ray gets GPUs 6 and 7 of every node (it started
    # with --num-gpus=0, and torchrun took every GPU: disaggregated engines could not start).
    status, out, calls = dry_run(tmp_path, node_gpus=8, ranks_per_node=6)
    assert status == 0, out
    ray = [c for c in calls if c.startswith("ray ")]
    assert [c.split()[1] for c in ray] == ["node=g1", "node=g2"], calls  # head and worker
    for call in ray:
        assert "CUDA_VISIBLE_DEVICES=6,7 start --num-gpus=2" in call, call
    (torchrun,) = [c for c in calls if c.startswith("torchrun ")]
    assert "--nproc-per-node=6" in torchrun and "rollout.mode=disaggregated" in torchrun, torchrun
    assert "6 rank(s) per node" in out and "with 2 GPU(s) per node" in out

    # Colocated (every GPU a rank's): Ray gets none, as before.
    status, out, calls = dry_run(tmp_path, node_gpus=8, ranks_per_node=None)
    assert status == 0, out
    assert all("CUDA_VISIBLE_DEVICES= start --num-gpus=0" in c for c in calls if c.startswith("ray ")), calls
    assert any("--nproc-per-node=8" in c for c in calls), calls

    status, out, _ = dry_run(tmp_path, node_gpus=8, ranks_per_node=9)
    assert status != 0 and "RLF_GPUS_PER_NODE=9 ranks per node, but the nodes have 8 GPUs" in out

"""Multi-node without Slurm, and MPI: the commands docs/launchers.md shows, run as written.
Two torchrun "nodes" on this host with two ranks each train with TP inside a node and DP across
the nodes (one engine per node, each DP rank trains rows); `mpiexec -n 2 rlf-train` trains at tp=2."""
import json
from pathlib import Path

from blocks import block_env, docs_block, run_block, workdir


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_nodes_tp_inside_dp_across(tmp_path):
    work = workdir(tmp_path)
    done = run_block(docs_block("multinode"), work, block_env(tmp_path), timeout=1200)
    node1 = (work / "outputs" / "multinode-node1.log").read_text()
    assert done.returncode == 0, done.stderr[-3000:] + "\n--- node 1:\n" + node1[-2000:]
    assert "node 0 of 2, 2 rank(s) here" in done.stderr and "node 1 of 2, 2 rank(s) here" in node1
    assert "tp=2 pp=1 on 4 rank(s)" in done.stdout  # world 4 = 2 nodes x 2: dp = 2, across the nodes
    assert done.stdout.count("rlf-train: grpo on") == 1  # rank 0 speaks for the job
    steps = [r for r in _records(work / "outputs" / "multinode") if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        # rollout.tp=2: one vLLM engine per node with two TP workers of its own (unpinned on a CPU
        # with one NUMA node), fed by that node's TP group, serving the actor's weights
        assert r["rollout/num_engines"] == 2
        assert r["train/dp_rows_min"] >= 1  # both DP ranks (one per node) trained on rows
        for i in range(2):
            assert r[f"rollout/engine_{i}_requests"] > 0 and r[f"rollout/engine_{i}_weight_version"] == r["step"] - 1
    shards = sorted(p.name for p in (work / "outputs" / "multinode" / "cache" / "rollouts").iterdir())
    assert shards == ["shard-00000-of-00002.h5", "shard-00001-of-00002.h5"]


def test_mpirun_trains(tmp_path):
    work = workdir(tmp_path)
    done = run_block(docs_block("mpirun"), work, block_env(tmp_path), timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "tp=2 pp=1 on 2 rank(s)" in done.stdout
    assert [r["step"] for r in _records(work / "outputs" / "mpirun") if r["step"] > 0] == [1]

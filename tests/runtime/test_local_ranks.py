"""Ranks started by hand (`spawn_local_workers`: rlf-train and rlf-convert without a launcher,
the multi-rank tests) fork on a CPU host from a server that imported torch and megatron once, yet
each call's ranks see the environment of the moment they start, as spawned ones would."""
import json
import os
import subprocess
import sys
from pathlib import Path

JOB = Path(__file__).parent / "local_ranks_job.py"


def test_a_later_call_s_ranks_see_the_environment_changed_since_the_fork_server_started():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "RLF_TEST_MARK")}
    done = subprocess.run([sys.executable, str(JOB)], capture_output=True, text=True, timeout=300,
                          env={**env, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = json.loads(done.stdout.strip().splitlines()[-1])
    assert [r["rank"] for r in first] == [r["rank"] for r in second] == [0, 1]
    assert all(r["mark"] is None and r["threads"] == 1 for r in first)
    assert all(r["mark"] == "changed" and r["threads"] == 2 for r in second)  # not the server's variables
    assert all(r["preloaded"] for r in first + second)  # megatron came with the fork, not imported again

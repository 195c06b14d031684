"""Ranks started without a launcher meet at a store bound on a port the OS picks as it binds
(runtime/distributed.py): a port picked free first and bound later can be taken in between by
another process on the host, which failed CI's docs quickstart with EADDRINUSE."""
import json
import os
import subprocess
import sys
from pathlib import Path

JOB = Path(__file__).parent / "rendezvous_job.py"


def test_ranks_started_by_hand_meet_although_a_picked_port_is_taken_meanwhile():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, str(JOB)], capture_output=True, text=True, timeout=300,
                          env={**env, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [[1.0], [3.0, 3.0], [1.0]]

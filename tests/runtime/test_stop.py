"""A stop signal ends every rank after the same step (runtime/stop.py), whether it reaches one
rank only (signals reach a job's processes at different moments; rank 0 here, which says so on
the console) or the parent that spawned the ranks (`kill <pid>` of a run started by hand),
which passes it on."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

JOB = Path(__file__).parent / "stop_job.py"


def _run(tmp_path, target: str, signum: int) -> list:
    proc = subprocess.Popen([sys.executable, str(JOB), str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    pids_file = tmp_path / "pids.json"
    deadline = time.monotonic() + 120
    while not pids_file.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() is not None else "slow"
        time.sleep(0.1)
    pids = json.loads(pids_file.read_text())
    os.kill(proc.pid if target == "parent" else pids[0], signum)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-3000:]
    assert f"{signal.Signals(signum).name} received: stopping after this step" in output
    return json.loads((tmp_path / "result.json").read_text())


@pytest.mark.parametrize("target,signum", [("one rank", signal.SIGTERM), ("parent", signal.SIGUSR1)])
def test_every_rank_stops_after_the_same_step(tmp_path, target, signum):
    (step0, by0), (step1, by1) = _run(tmp_path, target, signum)
    assert by0 == by1 == signum
    assert step0 == step1 and 5 <= step0 < 6000  # together, and well before the cap

"""A process's watched children end with it, even when it is SIGKILLed (runtime/reaper.py).

The owner here is a Python process that starts a long-lived child with a grandchild of its own
(the shape of vLLM's engine core and its TP workers), then a Reaper for the child. The real
engine case is in tests/slurm (a SIGKILLed rank's engine core does not survive it).
"""
import os
import signal
import subprocess
import sys
import time

import psutil

OWNER = r"""
import subprocess, sys, time
from rlfactory_megatron.runtime.reaper import Reaper, descendants, new_children
before = descendants()
# A child that starts a grandchild, both sleeping: as an engine core and its worker.
child = subprocess.Popen([sys.executable, "-c",
    "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"])
time.sleep(1.0)
reaper = Reaper(new_children(before))
print(" ".join(map(str, [child.pid, *[p for p in new_children(before) if p != child.pid and p != reaper.proc.pid]])), flush=True)
if sys.argv[1] == "close":
    child.kill(); child.wait(); reaper.close(); print("closed", flush=True)
time.sleep(600)
"""


def _owner(mode):
    return subprocess.Popen([sys.executable, "-c", OWNER, mode], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def _gone(pids, within_s):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.2)
    return False


def test_watched_processes_end_when_their_owner_is_sigkilled():
    owner = _owner("kill")
    pids = [int(p) for p in owner.stdout.readline().split()]
    assert len(pids) == 2, pids  # the child and its grandchild
    try:
        assert all(psutil.pid_exists(p) for p in pids)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        assert _gone(pids, within_s=30), f"still running after their owner was SIGKILLed: {pids}"
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_closed_watch_leaves_the_owner_alone_and_ends_the_watcher():
    owner = _owner("close")
    pids = [int(p) for p in owner.stdout.readline().split()]
    assert owner.stdout.readline().strip() == "closed"
    try:
        watchers = [p for p in psutil.Process(owner.pid).children() if "rlfactory_megatron.runtime.reaper" in " ".join(p.cmdline())]
        assert watchers == []  # close() ended it; the owner runs on
        assert owner.poll() is None
    finally:
        owner.kill()
        owner.wait()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

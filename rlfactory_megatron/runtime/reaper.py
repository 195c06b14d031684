"""Processes that must not outlive the process that started them, however it ends.

vLLM's engine core runs in a process of its own inside a multi-rank job. When the rank is
SIGKILLed (the OOM killer, a Slurm step cancelled on a cluster whose process tracking goes by
parentage, a user's `kill -9`), nothing tells that process: it keeps the model's memory (the
GPU's, on a cluster) for the rest of the job and beyond. A kernel parent-death signal cannot be
set on a process someone else's code starts, so a small watcher does it: it polls its own
parent, and when that is gone it ends the processes it was given (SIGTERM, then SIGKILL).

    python -m rlfactory_megatron.runtime.reaper PARENT_PID PID [PID ...]
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL_S = 0.5  # how often the watcher looks at its parent
TERM_GRACE_S = 5.0  # between SIGTERM and SIGKILL


def descendants() -> set[int]:
    """The pids of this process's children, theirs, and so on."""
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def new_children(before: set[int]) -> list[int]:
    """This process's descendants that were not in `before`."""
    return sorted(descendants() - before)


class Reaper:
    """The watcher of `pids` for this process. `close()` ends the watch (the processes have
    been shut down properly); a process that dies without it leaves the watcher to act."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = list(pids)
        self.proc = None
        if self.pids:
            # Its own session: a signal to this process's group (Ctrl-C, a step's SIGTERM) must not
            # end the watcher before the processes it watches.
            self.proc = subprocess.Popen([sys.executable, "-m", __name__, str(os.getpid()), *map(str, self.pids)],
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def _end(processes) -> None:
    import psutil

    # With their own children (an engine core's TP workers).
    everyone = []
    for process in processes:
        try:
            everyone += [process, *process.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for process in everyone:
        try:
            process.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(everyone, timeout=TERM_GRACE_S)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def main(argv: list[str]) -> int:
    import psutil

    parent, pids = int(argv[0]), [int(pid) for pid in argv[1:]]
    processes = []
    for pid in pids:
        try:
            # psutil.Process remembers the start time: a pid reused later is not touched.
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    while os.getppid() == parent and any(p.is_running() for p in processes):
        time.sleep(POLL_S)
    if os.getppid() != parent:
        _end([p for p in processes if p.is_running()])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

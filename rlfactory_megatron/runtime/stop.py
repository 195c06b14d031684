"""A graceful stop on SIGTERM or SIGUSR1: the run ends its step, saves a checkpoint and exits.

These are what a cluster sends before it ends a job: Slurm's `scancel` and preemption send
SIGTERM (SIGKILL follows after `KillWait`), `#SBATCH --signal=USR1@120` sends SIGUSR1 ahead of
the time limit, and torchrun forwards SIGTERM to its workers (SIGKILL after 30 s). Without this
the run would die mid-step and lose everything since its last periodic checkpoint.

Slurm delivers a signal to every process of the job step: Ray's and vLLM's too, which SIGUSR1's
default action would end. So a rank ignores SIGUSR1 before it starts any of them
(`ignore_usr1_in_helpers`): an ignored disposition survives fork and exec, and the processes they
start (Ray's raylet and workers, tool actors and their sandboxes, engine processes) inherit it;
the rank itself then takes it with the handler. SIGTERM is left to end them (it is also how a
job is cancelled outright), so under Slurm a graceful stop is SIGUSR1's.

The handler only records the signal; `StopRequest.agreed()` is a collective at a step boundary
so that every rank stops after the same step (a signal reaches the ranks at different moments).
A second signal ends the process at once, as if no handler were installed. The exit status is
128 + the signal's number, as for a process the signal killed: the run did not finish.
"""
from __future__ import annotations

import os
import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def ignore_usr1_in_helpers() -> None:
    """Before this process starts any other: they and theirs ignore SIGUSR1 (see above). Until a
    StopRequest takes it, this process ignores it too."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


class StopRequest:
    """Installed for the duration of a `with` block (main thread only: Python runs handlers there)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._received)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _received(self, signum: int, frame) -> None:
        if self.signum is not None:  # the second one: stop now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        if os.environ.get("RANK", "0") == "0":  # on the console (a rank's stderr goes to its log), once
            print(f"rlf-train: {signal.Signals(signum).name} received: stopping after this step with a "
                  f"checkpoint (send it again to stop at once)", flush=True)

    def agreed(self) -> int | None:
        """Collective over all ranks: the signal any rank received (None if none did), so that all
        stop together."""
        import torch
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.signum
        received = torch.tensor([self.signum or 0], dtype=torch.int64)
        dist.all_reduce(received, op=dist.ReduceOp.MAX)
        return int(received.item()) or None


def forward_stop_signals(processes) -> dict[int, object]:
    """In a parent that started the ranks itself: pass a stop signal on to `processes` (each
    rank then stops by itself). Returns the previous handlers, for `signal.signal` to restore."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def forward(signum, frame):
        for process in processes:
            if process.is_alive():
                os.kill(process.pid, signum)

    return {signum: signal.signal(signum, forward) for signum in STOP_SIGNALS}

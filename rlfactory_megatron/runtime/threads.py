"""CPU threads per rank when the user set none: the ranks of this node share its cores, and one
core is left to what runs beside them (the tool and reward actors, the agent loop's event loop,
an engine's helper processes). Torch's default, a thread per core in every rank, oversubscribes
the cores as soon as anything else runs and makes the run's float summation order depend on
the machine's core count."""
from __future__ import annotations

import os

# What a user sets to choose; any one of them set means rlf-train chooses nothing.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_rank(cores: int, ranks_on_node: int) -> int:
    spare = 1 if cores > 1 else 0
    return max(1, (cores - spare) // max(1, ranks_on_node))


def choose_threads(ranks_on_node: int, chosen_before: bool = False) -> str | None:
    """Set OMP_NUM_THREADS for this process and the ones it starts, unless the user set a thread
    variable (`chosen_before`: the value there is this function's own, to be revised); returns the
    line that says what was chosen (None when the user's choice stands). Must run before torch is
    imported: the OpenMP runtime reads the variable once, when it loads, for every thread."""
    if not chosen_before and any(os.environ.get(var) for var in THREAD_VARIABLES):
        return None
    cores = usable_cores()
    threads = threads_per_rank(cores, ranks_on_node)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    left = cores - threads * ranks_on_node
    room = f"{left} left for tools, rewards and engines" if left >= 0 else "ranks outnumber cores"
    return (f"OMP_NUM_THREADS={threads} per rank ({cores} usable cores, {ranks_on_node} rank(s) on this node, "
            f"{room}); set OMP_NUM_THREADS to choose")

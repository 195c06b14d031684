"""Two spawned ranks stepping until a stop signal (runtime/stop.py), as rlf-train's loop does:
`python stop_job.py OUT`. Rank pids go to OUT/pids.json once both are stepping; the ranks'
(last step, signal) to OUT/result.json when they stop."""
import json
import os
import sys
import time
from pathlib import Path

MAX_STEPS = 6000  # ~1 minute: a stop that never comes fails the test instead of hanging it


def rank(out: str):
    import torch.distributed as dist

    from rlfactory_megatron.runtime.stop import StopRequest

    dist.init_process_group("gloo")
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    with StopRequest() as stop:
        for step in range(1, MAX_STEPS + 1):
            time.sleep(0.01)  # the step's work
            if step == 5 and dist.get_rank() == 0:
                (Path(out) / "pids.json").write_text(json.dumps(pids))
            stopped_by = stop.agreed()
            if stopped_by is not None:
                break
    dist.destroy_process_group()
    return step, stopped_by


if __name__ == "__main__":
    from rlfactory_megatron.runtime.distributed import spawn_local_workers

    results = spawn_local_workers(rank, 2, sys.argv[1])
    (Path(sys.argv[1]) / "result.json").write_text(json.dumps(results))

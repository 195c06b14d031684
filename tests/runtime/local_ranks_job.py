"""Two calls of spawn_local_workers in one process, the environment changed in between; prints
what each rank saw (runtime/distributed.py's fork server must not hand a later call the variables
of its own start)."""
import json
import os
import sys


def what_the_rank_sees() -> dict:
    import torch

    return {"mark": os.environ.get("RLF_TEST_MARK"), "threads": torch.get_num_threads(),
            "rank": int(os.environ["RANK"]), "preloaded": "megatron.core" in sys.modules}


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))  # the ranks import this file's function by its module name
    from local_ranks_job import what_the_rank_sees as entry
    from rlfactory_megatron.runtime.distributed import spawn_local_workers

    first = spawn_local_workers(entry, 2)
    os.environ.update(RLF_TEST_MARK="changed", OMP_NUM_THREADS="2")
    second = spawn_local_workers(entry, 2)
    print(json.dumps([first, second]))

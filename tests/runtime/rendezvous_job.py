"""Ranks started by hand meet although a port picked free beforehand is taken:
`python rendezvous_job.py`. A port picker (`free_port`, what runtime/ picked the rendezvous port
with until it bound its store on port 0) hands out ports already held by a listening socket, as
when another process on the host takes one in between (CI, tests in parallel); one rank in this
process, then two spawned ranks, then one again all-reduce their rank + 1 and print the sums."""
import json
import socket

from rlfactory_megatron.runtime import launch_env

_taken = []


def _free_port_then_taken() -> int:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    _taken.append(sock)
    return sock.getsockname()[1]


launch_env.free_port = _free_port_then_taken


def rank_sum() -> float:
    import torch
    import torch.distributed as dist

    from rlfactory_megatron.runtime.distributed import ParallelSizes, destroy_distributed, init_distributed

    init_distributed(ParallelSizes(1, 1))
    value = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(value)
    destroy_distributed()
    return value.item()


if __name__ == "__main__":
    from rlfactory_megatron.runtime import distributed

    distributed.free_port = _free_port_then_taken  # in case it picks by a name of its own
    print(json.dumps([distributed.run_as_job(rank_sum, 1), distributed.run_as_job(rank_sum, 2),
                      distributed.run_as_job(rank_sum, 1)]))

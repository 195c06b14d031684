"""A vLLM engine hosted in a Ray actor (disaggregated rollout) and the broadcast transport that feeds it.

Weights travel over a two-member process group of their own (the sending training rank and
the actor): gloo on CPU, NCCL on GPU. Each bucket is one flat byte buffer; its layout (names,
dtypes, shapes) goes with the Ray call that receives it.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from rlfactory_megatron.rollout.engines import Generation, SamplingConfig, VLLMEngine
from rlfactory_megatron.rollout.weight_sync import TRANSPORTS, Transport


def _pair_group(host: str, port: int, rank: int, backend: str, timeout_s: float):
    """A process group of exactly two processes, independent of any torch.distributed world."""
    store = dist.TCPStore(host, port, world_size=2, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, 2)
    return dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout_s))


def _broadcast_from_sender(group, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def _layout(named: list[tuple[str, torch.Tensor]]) -> dict:
    return {"names": [n for n, _ in named], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named],
            "nbytes": [t.numel() * t.element_size() for _, t in named]}


class VLLMEngineHost:
    """The body of the Ray actor: one VLLMEngine plus the receiving end of the weight group."""

    def __init__(self, hf_dir: str, **engine_kwargs) -> None:
        self.engine = VLLMEngine(hf_dir, in_process=True, **engine_kwargs)
        self.group = None
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seeds=None) -> list[list[Generation]]:
        return self.engine.generate(prompts, sampling, seeds)

    def weight_names(self) -> dict[str, tuple[int, ...]]:
        return self.engine.weight_names()

    def join_weight_group(self, host: str, port: int, backend: str, timeout_s: float) -> bool:
        self.group = _pair_group(host, port, 1, backend, timeout_s)
        return True

    def receive_bucket(self, layout: dict) -> int:
        buffer = torch.empty(sum(layout["nbytes"]), dtype=torch.uint8, device=self.device)
        _broadcast_from_sender(self.group, buffer)
        named, offset = [], 0
        for name, dtype, shape, nbytes in zip(layout["names"], layout["dtypes"], layout["shapes"], layout["nbytes"]):
            named.append((name, buffer[offset : offset + nbytes].view(getattr(torch, dtype)).reshape(shape)))
            offset += nbytes
        self.engine.load_weights(named)
        return offset

    def finish_weight_update(self) -> None:
        self.engine.finish_weight_update()

    def close(self) -> None:
        self.engine.close()


class RayVLLMEngine:
    """Client for a VLLMEngineHost actor with the rollout-engine interface (blocking calls)."""

    def __init__(self, hf_dir: str, num_cpus: float = 1, num_gpus: float = 0, **engine_kwargs) -> None:
        import ray

        host_cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(VLLMEngineHost)
        self._ray = ray
        self.actor = host_cls.remote(hf_dir, **engine_kwargs)

    def generate(self, prompts, sampling, seeds=None):
        return self._ray.get(self.actor.generate.remote(prompts, sampling, seeds))

    def weight_names(self):
        return self._ray.get(self.actor.weight_names.remote())

    def close(self) -> None:
        self._ray.get(self.actor.close.remote())
        self._ray.kill(self.actor)


@TRANSPORTS.register("broadcast")
class BroadcastTransport(Transport):
    """Sends buckets from this training rank to a RayVLLMEngine over a dedicated 2-process group."""

    def __init__(self, engine: RayVLLMEngine, host: str = "127.0.0.1", timeout_s: float = 600.0) -> None:
        from rlfactory_megatron.runtime.launch_env import free_port

        self.engine = engine
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        port = free_port()
        # Both ends must construct the group at the same time: start the remote side first.
        joined = engine.actor.join_weight_group.remote(host, port, backend, timeout_s)
        self.group = _pair_group(host, port, 0, backend, timeout_s)
        engine._ray.get(joined)

    def expected_weights(self):
        return self.engine.weight_names()

    def send(self, bucket):
        flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket]).to(self.device)
        received = self.engine.actor.receive_bucket.remote(_layout(bucket))
        _broadcast_from_sender(self.group, flat)
        self.engine._ray.get(received)

    def finish(self):
        self.engine._ray.get(self.engine.actor.finish_weight_update.remote())

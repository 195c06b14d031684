"""Python objects between a job's training ranks, over gloo whatever the training backend
(NCCL moves only device tensors): broadcast from rank 0, all-gather, point to point."""
from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist


class RankCollectives:
    """The job's gloo group and the object collectives the rollout side runs on it; every
    method is called on every rank (of `group`, where one is given)."""

    def __init__(self) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")

    def subgroup(self, ranks: list[int]):
        """A gloo group of `ranks` (every rank creates it, as torch requires; only they use it)."""
        return dist.new_group(ranks=ranks, backend="gloo") if len(ranks) < self.world else self.group

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj`, on every rank."""
        box = [obj]
        if self.world > 1:
            dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj: Any, group=None, size: int | None = None) -> list[Any]:
        """`obj` from every rank of `group` (of `size` ranks; default: the whole job)."""
        size = self.world if size is None else size
        if size == 1:
            return [obj]
        out: list[Any] = [None] * size
        dist.all_gather_object(out, obj, group=self.group if group is None else group)
        return out

    def exchange(self, outgoing: dict[int, Any]) -> dict[int, Any]:
        """Point to point: `outgoing[rank]` goes to that rank alone; returns {sender: object} of
        what was sent here. One all-gather of the byte counts, then a send per pair."""
        me, world = self.rank, self.world
        received = {me: outgoing[me]} if me in outgoing else {}
        if world == 1:
            return received
        payloads = {dst: torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                                          dtype=torch.uint8)
                    for dst, obj in outgoing.items() if dst != me}
        sizes = torch.zeros(world, dtype=torch.int64)
        for dst, payload in payloads.items():
            sizes[dst] = payload.numel()
        table = [torch.zeros(world, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(table, sizes, group=self.group)
        inbox = {src: torch.empty(int(table[src][me]), dtype=torch.uint8)
                 for src in range(world) if src != me and int(table[src][me]) > 0}
        requests = [dist.isend(payload, dst, group=self.group) for dst, payload in payloads.items()]
        requests += [dist.irecv(buffer, src, group=self.group) for src, buffer in inbox.items()]
        for request in requests:
            request.wait()
        received.update({src: pickle.loads(buffer.numpy().tobytes()) for src, buffer in inbox.items()})
        return received

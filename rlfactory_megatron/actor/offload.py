"""A model's training state (parameters, gradients, optimizer states) moved to host memory while
colocated engines use the device, and back, bit for bit, before training needs it.

Whole storages move, not tensors: megatron's parameters and gradients are views of flat buffers,
and every view stays valid (its storage is emptied on the device and refilled later). On a
machine without a GPU the same code moves host memory to host memory, so the CPU tests run it.

Host memory is one flat buffer per kind, kept for the next step: torch's pinned allocator would
round each storage up to a power of two and cache it (up to twice the state, never released), so
the buffer is ordinary host memory registered with CUDA (pinned) once, at its exact size.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.cuda._pin_memory_utils as pin_memory_utils  # what torch's own checkpoint stager pins with

# What a model's state is made of, in the order that decides a storage's kind when two kinds
# share it (an fp32 optimizer updates the parameters themselves: those stay parameters).
KINDS = ("params", "grads", "optimizer")


@dataclass
class _Away:
    """One storage while it is off the device."""

    kind: str
    storage: torch.UntypedStorage  # emptied on the device; refilled on the way back
    nbytes: int
    host: torch.Tensor | None  # its bytes: a view of its kind's host buffer; None: not kept (gradients: zeroed on return)


class HostOffload:
    """Moves the storages that `state()` lists, by kind, to host memory and back.

    Gradients are freed, not copied: every training step zeroes them before its backward pass, so
    their values between steps are never read; they come back as zeros."""

    def __init__(self, state: Callable[[], dict[str, Iterable[torch.Tensor]]]) -> None:
        self._state = state
        self._away: dict[int, _Away] = {}
        self._buffers: dict[str, torch.Tensor] = {}  # kind -> its flat host buffer, reused every step
        self._releases: dict[str, weakref.finalize] = {}

    def offloaded(self, kind: str) -> bool:
        return any(away.kind == kind for away in self._away.values())

    def host_buffers(self) -> dict[str, torch.Tensor]:
        """The host memory kept for each kind that has been away (reused by every later offload)."""
        return dict(self._buffers)

    def resident_bytes(self, kinds: Iterable[str] = KINDS) -> int:
        """Bytes of `kinds` on the device now."""
        return sum(storage.nbytes() for kind, storage in self._storages().values() if kind in kinds)

    def offload(self, kinds: Iterable[str] = KINDS) -> int:
        """Move the storages of `kinds` to host memory (those already there stay); returns the
        bytes freed on the device."""
        kinds = set(kinds)
        moving: dict[str, list[tuple[int, torch.UntypedStorage]]] = {}
        for key, (kind, storage) in self._storages().items():
            if kind in kinds and key not in self._away and storage.nbytes() > 0:
                moving.setdefault(kind, []).append((key, storage))
        for kind, storages in moving.items():
            sizes = [storage.nbytes() for _, storage in storages]
            hosts = [None] * len(storages) if kind == "grads" else self._host_views(kind, sizes)
            for (key, storage), host in zip(storages, hosts):
                if host is not None:
                    host.copy_(_bytes(storage), non_blocking=True)
                self._away[key] = _Away(kind, storage, storage.nbytes(), host)
        _synchronize()  # every copy has landed before its source is freed
        freed = 0
        for storages in moving.values():
            for _, storage in storages:
                freed += storage.nbytes()
                storage.resize_(0)
        return freed

    def onload(self, kinds: Iterable[str] = KINDS) -> None:
        """Bring the storages of `kinds` back where they were (a no-op for those not away)."""
        returning = {key: away for key, away in self._away.items() if away.kind in kinds}
        for away in returning.values():
            away.storage.resize_(away.nbytes)
            if away.host is None:
                _bytes(away.storage).zero_()
            else:
                _bytes(away.storage).copy_(away.host, non_blocking=True)
        if returning:
            _synchronize()  # before the host buffers are written again
        for key in returning:
            del self._away[key]

    def _host_views(self, kind: str, sizes: list[int]) -> list[torch.Tensor]:
        """Consecutive views of `kind`'s host buffer, one per size; the buffer is made (or made
        again, when the state outgrew it) at exactly their sum."""
        if self.offloaded(kind):
            raise RuntimeError(f"offload: part of {kind!r} is in host memory already; a kind moves whole")
        total = sum(sizes)
        buffer = self._buffers.get(kind)
        if buffer is None or buffer.numel() < total:
            if kind in self._releases:
                self._releases.pop(kind)()  # the outgrown buffer: unregistered and let go now
            buffer = self._buffers[kind] = _pinned(total)
            # Registered memory is unregistered before it is freed (here, or with this object; at
            # exit the process's memory goes whole, and CUDA may be gone before the finalizer runs).
            self._releases[kind] = weakref.finalize(self, _unpin, buffer)
            self._releases[kind].atexit = False
        return list(buffer[:total].split(sizes))

    def _storages(self) -> dict[int, tuple[str, torch.UntypedStorage]]:
        """Every storage of the state once, keyed by identity, with the first kind listing it.
        A storage already offloaded keeps its record (an empty storage cannot be told apart)."""
        found: dict[int, tuple[str, torch.UntypedStorage]] = {}
        state = self._state()
        for kind in KINDS:
            for tensor in state.get(kind, ()):
                storage = tensor.untyped_storage()
                found.setdefault(storage._cdata, (kind, storage))
        return found


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _pinned(nbytes: int) -> torch.Tensor:
    """`nbytes` of host memory, pinned where CUDA is."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if torch.cuda.is_available() and nbytes:
        pin_memory_utils.pin_memory(buffer.data_ptr(), nbytes)
    return buffer


def _unpin(buffer: torch.Tensor) -> None:
    if torch.cuda.is_available() and buffer.numel():
        pin_memory_utils.unpin_memory(buffer.data_ptr())


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def megatron_state(chunks: list[torch.nn.Module], optimizer) -> dict[str, list[torch.Tensor]]:
    """The tensors of a megatron model's state: its chunks' parameters and, when it trains (DDP
    chunks and an optimizer), the DDP gradient buffers and the optimizer's tensors (fp32 main
    parameters, Adam moments). Optimizer tensors kept in host memory already (torch's Adam keeps
    `step` there on GPU) stay where they are."""
    params = [p for chunk in chunks for p in chunk.parameters()]
    if optimizer is None:
        return {"params": params}
    grads = [buffer.grad_data for chunk in chunks for buffer in (*chunk.buffers, *chunk.expert_parallel_buffers)]
    device = params[0].device
    tensors = []
    for inner in _torch_optimizers(optimizer):
        tensors += [p for group in inner.param_groups for p in group["params"]]
        tensors += [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return {"params": params, "grads": grads, "optimizer": [t for t in tensors if t.device == device]}


def _torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside megatron's (chained) optimizer."""
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [part.optimizer for part in parts if getattr(part, "optimizer", None) is not None]

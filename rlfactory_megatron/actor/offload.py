"""A model's training state (parameters, gradients, optimizer states) moved to host memory while
colocated engines use the device, and back, bit for bit, before training needs it.

Whole storages move, not tensors: megatron's parameters and gradients are views of flat buffers,
and every view stays valid (its storage is emptied on the device and refilled later). On a
machine without a GPU the same code moves host memory to host memory, so the CPU tests run it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

# What a model's state is made of, in the order that decides a storage's kind when two kinds
# share it (an fp32 optimizer updates the parameters themselves: those stay parameters).
KINDS = ("params", "grads", "optimizer")


@dataclass
class _Away:
    """One storage while it is off the device."""

    kind: str
    storage: torch.UntypedStorage  # emptied on the device; refilled on the way back
    nbytes: int
    host: torch.Tensor | None  # its bytes in host memory; None: not kept (gradients: zeroed on return)


class HostOffload:
    """Moves the storages that `state()` lists, by kind, to host memory and back.

    Gradients are freed, not copied: every training step zeroes them before its backward pass, so
    their values between steps are never read; they come back as zeros."""

    def __init__(self, state: Callable[[], dict[str, Iterable[torch.Tensor]]]) -> None:
        self._state = state
        self._away: dict[int, _Away] = {}

    def offloaded(self, kind: str) -> bool:
        return any(away.kind == kind for away in self._away.values())

    def resident_bytes(self, kinds: Iterable[str] = KINDS) -> int:
        """Bytes of `kinds` on the device now."""
        return sum(storage.nbytes() for kind, storage in self._storages().values() if kind in kinds)

    def offload(self, kinds: Iterable[str] = KINDS) -> int:
        """Move the storages of `kinds` to host memory (those already there stay); returns the
        bytes freed on the device."""
        kinds = set(kinds)
        moving = []
        for key, (kind, storage) in self._storages().items():
            if kind in kinds and key not in self._away and storage.nbytes() > 0:
                moving.append((key, kind, storage))
        pin = torch.cuda.is_available()
        for key, kind, storage in moving:
            host = None
            if kind != "grads":
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                host.copy_(_bytes(storage), non_blocking=pin)
            self._away[key] = _Away(kind, storage, storage.nbytes(), host)
        _synchronize()  # every copy has landed before its source is freed
        for _, _, storage in moving:
            storage.resize_(0)
        return sum(self._away[key].nbytes for key, _, _ in moving)

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
            _synchronize()  # before the host buffers are released
        for key in returning:
            del self._away[key]

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

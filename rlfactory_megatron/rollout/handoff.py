"""Weight buckets handed to an engine's workers in other processes by handle, never as bytes.

A bucket is packed into one of two staging buffers that other processes can map
(torch.multiprocessing's tensor sharing: CUDA IPC on a GPU, shared memory on the host, one
code path); only a handle and the bucket's layout cross to the workers, which load the
tensors straight from the buffer. A buffer is packed again only after the engine has loaded
what it held, so at most two staged buckets are alive during a sync. On a GPU the buffers are
freed when the sync ends (device memory goes back to training); host buffers stay for the next
sync, where fresh shared memory would cost a page fault per 4 KiB on both sides.
"""
from __future__ import annotations

import io
import itertools
import os
import pickle
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions with ForkingPickler)
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor


def bucket_layout(named: list[tuple[str, torch.Tensor]]) -> dict:
    """Names, dtypes, shapes and byte sizes of a bucket's tensors: what rebuilds them from one flat buffer."""
    return {"names": [n for n, _ in named], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named],
            "nbytes": [t.numel() * t.element_size() for _, t in named]}


# Each tensor starts at a multiple of this in the flat buffer: any dtype can view its bytes, and a
# strided source (e.g. q, k, v cut from a fused QKV) is copied in once, not first made contiguous.
_ALIGN = 16


def _offsets(layout: dict) -> list[int]:
    """Where each tensor of the layout starts in the flat buffer, and (last) the buffer's size."""
    offsets = [0]
    for nbytes in layout["nbytes"]:
        offsets.append(offsets[-1] + (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN)
    return offsets


def packed_size(layout: dict) -> int:
    return _offsets(layout)[-1]


def _views(buffer: torch.Tensor, layout: dict) -> list[torch.Tensor]:
    offsets = _offsets(layout)
    return [buffer[start:start + nbytes].view(getattr(torch, dtype)).view(shape)
            for start, nbytes, dtype, shape in zip(offsets, layout["nbytes"], layout["dtypes"], layout["shapes"])]


def pack_into(buffer: torch.Tensor, named: list[tuple[str, torch.Tensor]], layout: dict) -> None:
    """Copies the bucket's tensors (of `layout`) into the uint8 `buffer`, of at least `packed_size` bytes."""
    for view, (_, tensor) in zip(_views(buffer, layout), named):
        view.copy_(tensor.detach())


def unpack(buffer: torch.Tensor, layout: dict) -> list[tuple[str, torch.Tensor]]:
    """The bucket's (name, tensor) pairs as views of the flat uint8 `buffer` (no copy)."""
    return list(zip(layout["names"], _views(buffer, layout)))


def share(tensor: torch.Tensor) -> bytes:
    """A handle to `tensor`'s memory that another process opens with `open_shared` (a few hundred
    bytes, whatever the tensor's size). On a GPU it names the device by UUID: the receiving
    process may number its visible devices differently."""
    if tensor.is_cuda:
        _, args = reduce_tensor(tensor)
        return pickle.dumps(("cuda", str(torch.cuda.get_device_properties(tensor.device).uuid), args))
    buffer = io.BytesIO()
    ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(("host", None, tensor))
    return buffer.getvalue()


def open_shared(handle: bytes) -> torch.Tensor:
    """The tensor a `share` handle points to, mapped into this process (no copy)."""
    kind, uuid, payload = pickle.loads(handle)
    if kind == "host":
        return payload
    args = list(payload)
    args[6] = next(index for index in range(torch.cuda.device_count())
                   if str(torch.cuda.get_device_properties(index).uuid) == uuid)  # the storage's device
    return rebuild_cuda_tensor(*args)


class StagingBuffers:
    """Two flat buffers per device, reused bucket after bucket (and, on the host, sync after sync).

    `devices[r]` is where worker r of the engine reads its copy: the sender's own device for a
    colocated engine, each worker's own device for an engine hosted in a process of its own (a
    worker then never maps another device's memory). Each buffer is shared once per worker; later
    buckets in it name it by key only, and every bucket lists the buffers still alive, so that a
    worker unmaps the others."""

    _ids = itertools.count()

    def __init__(self, devices: list[torch.device]) -> None:
        self.devices = devices
        self._slots: dict[tuple[torch.device, int], tuple[str, torch.Tensor]] = {}
        self._shared: set[tuple[str, int]] = set()  # (buffer key, worker) pairs whose handle went out
        self._parity = 0

    def stage(self, named: list[tuple[str, torch.Tensor]]) -> dict:
        """Packs the bucket into the next buffer of each device; returns what the workers need
        (`open_staged` rebuilds it). The caller must know that the engine has loaded the bucket
        staged two calls ago: its buffer is overwritten here."""
        layout = bucket_layout(named)
        size = packed_size(layout)
        parity, self._parity = self._parity, 1 - self._parity
        packed: dict[torch.device, str] = {}
        source = None
        for device in dict.fromkeys(self.devices):
            key, buffer = self._slot(device, parity, size)
            if source is None:
                pack_into(buffer, named, layout)
                source = buffer
            else:  # a device-to-device copy of the first device's packed bytes
                buffer[:size].copy_(source[:size])
            packed[device] = key
        if source.is_cuda:  # the workers read it from other processes: the copies must be done
            for device in packed:
                torch.cuda.synchronize(device)
        workers = []
        for worker, device in enumerate(self.devices):
            key = packed[device]
            first_time = (key, worker) not in self._shared
            self._shared.add((key, worker))
            workers.append({"key": key, "handle": share(self._slots[device, parity][1]) if first_time else None})
        return {"layout": layout, "workers": workers, "alive": self.alive()}

    def alive(self) -> list[str]:
        """The keys of the buffers held now."""
        return [key for key, _ in self._slots.values()]

    @property
    def on_gpu(self) -> bool:
        """Whether the buffers are device memory (under the device discipline a CPU's are not)."""
        return any(buffer.is_cuda for _, buffer in self._slots.values())

    def _slot(self, device: torch.device, parity: int, size: int) -> tuple[str, torch.Tensor]:
        slot = self._slots.get((device, parity))
        if slot is None or slot[1].numel() < size:  # a larger bucket (one oversized group) gets a new buffer
            buffer = torch.empty(size, dtype=torch.uint8, device=device).share_memory_()
            slot = self._slots[device, parity] = (f"{os.getpid()}-{next(self._ids)}", buffer)
        return slot

    def end_of_sync(self) -> list[str]:
        """The keys of the buffers kept for the next sync; on a GPU none: they are freed once the
        workers have unmapped them (call `release` after the update's finish)."""
        return [] if self.on_gpu else self.alive()

    def release(self) -> None:
        """Frees a GPU's buffers (the workers have unmapped them: `end_of_sync` told them to)."""
        if self.on_gpu:
            self._slots.clear()
            self._shared.clear()
            torch.cuda.ipc_collect()  # blocks a worker mapped stay reserved until collected


def open_staged(staged: dict, worker: int, opened: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Worker side of `StagingBuffers.stage`: the bucket's tensors, views of the sender's buffer.
    `opened` keeps the buffers this worker has mapped, by key."""
    keep_only(opened, staged["alive"])
    entry = staged["workers"][worker]
    if entry["handle"] is not None:
        opened[entry["key"]] = open_shared(entry["handle"])
    return unpack(opened[entry["key"]], staged["layout"])


def keep_only(opened: dict[str, torch.Tensor], alive: list[str]) -> None:
    """Unmaps the buffers the sender no longer holds."""
    for key in set(opened) - set(alive):
        del opened[key]

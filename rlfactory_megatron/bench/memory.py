"""Peak memory of a step for the benchmarks: the high-water mark above the memory in use when the
step started, on CPU (/proc/self/status VmHWM, reset with `clear_refs` 5: torch has no CPU
allocator stats) or CUDA (torch.cuda.max_memory_allocated)."""
from __future__ import annotations

import re

import torch

# A process started with this in its environment gives freed blocks >= 1 MiB back at once:
# without a fixed threshold glibc keeps freed mid-sized blocks in its heap, and RSS would count
# them as live (the fused log-prob's 16 MiB chunks read as 300 MiB instead of 50).
RETURN_FREED_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter the variable above sets


def return_freed_memory() -> None:
    """The same threshold for this process, set now: a rank forked from a server that started
    without the variable (runtime/distributed.py's fork server on CPU) never read it."""
    import ctypes
    import ctypes.util

    libc = ctypes.util.find_library("c")
    if libc is not None and hasattr(ctypes.CDLL(libc), "mallopt"):
        ctypes.CDLL(libc).mallopt(_M_MMAP_THRESHOLD, 1 << 20)


def _cpu_memory() -> tuple[int, int]:
    status = open("/proc/self/status").read()
    return tuple(int(re.search(rf"{key}:\s+(\d+) kB", status).group(1)) * 1024 for key in ("VmHWM", "VmRSS"))


def reset_peak(device: torch.device) -> int:
    """Reset the peak-memory mark; return the memory in use now (the baseline)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _cpu_memory()[1]


def peak(device: torch.device) -> int:
    """The highest memory in use since reset_peak."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return _cpu_memory()[0]

"""Device discipline for CPU runs: fail where a GPU run would (`RLF_DEVICE_DISCIPLINE=1`).

On a host without a GPU every tensor is a host tensor, so code that a GPU would stop (`.numpy()`
of a device tensor, a device tensor pickled for another process, an op mixing device and host
tensors) passes unnoticed. Under this mode the CPU stands in for the device: `compute_device()`
names CUDA, which cpu_compat maps to the CPU, and every tensor that would live on a GPU (put
there by `.cuda()`, `.to(compute_device())` or a `device="cuda"` factory, and everything computed
from it) is marked, as is every tensor that would be on the host; host-only operations on a
marked tensor, and a host tensor indexed by device indices, raise `DeviceDisciplineError` naming
the line. cpu_compat enters it in every thread the process starts.
"""
from __future__ import annotations

import contextlib
import os
import threading
import traceback

import torch

ENV = "RLF_DEVICE_DISCIPLINE"

# Where a tensor lives on a GPU run, kept on its storage: views and `param.data = t` share it.
_ATTR = "_rlf_placement"
DEVICE, HOST = "device", "host"


class DeviceDisciplineError(RuntimeError):
    """An operation that a GPU run would refuse (or that would copy through the host there)."""


def requested() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def placement(tensor: torch.Tensor) -> str | None:
    """DEVICE, HOST, or None where a GPU run's placement cannot be told (e.g. a gradient autograd made)."""
    try:
        return getattr(tensor.untyped_storage(), _ATTR, None)
    except (RuntimeError, NotImplementedError):  # no storage (sparse, meta)
        return None


def _mark(tensor: torch.Tensor, where: str) -> None:
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return
    if getattr(storage, _ATTR, None) is None:
        setattr(storage, _ATTR, where)


def _is_cuda(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # a bare index means a CUDA device


def _placement_asked(device: object) -> str | None:
    """The placement a device argument asks for: a CUDA device -> DEVICE; the string "cpu" ->
    HOST. A `torch.device("cpu")` object says nothing: on CPU it is also what `x.device` of a
    would-be GPU tensor returns."""
    if _is_cuda(device):
        return DEVICE
    if isinstance(device, str) and device.startswith("cpu"):
        return HOST
    return None


def _where_in_user_code() -> str:
    """The line that made the call: the innermost frame outside torch and this module, and the
    innermost of this project's own code when that is a library's."""
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    torch_dir = os.path.dirname(torch.__file__)
    frames = [f for f in traceback.extract_stack()[:-3]
              if not f.filename.startswith(torch_dir) and not f.filename.endswith(("device_discipline.py", "cpu_compat.py"))]
    if not frames:
        return "<unknown>"
    line = f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})"
    ours = [f for f in frames if f.filename.startswith(checkout) and "site-packages" not in f.filename]
    if ours and ours[-1] is not frames[-1]:
        line += f", called from {ours[-1].filename}:{ours[-1].lineno} ({ours[-1].line})"
    return line


def _refuse(what: str) -> None:
    raise DeviceDisciplineError(f"device discipline ({ENV}=1): {what}, at {_where_in_user_code()}")


_TO, _CUDA, _CPU = torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu
_NUMPY = (torch.Tensor.numpy, torch.Tensor.__array__)
_INDEXING = (torch.Tensor.__getitem__, torch.Tensor.__setitem__)
# Calls that may take device and host tensors together on a GPU: transfers, indexing a device
# tensor with host indices (or assigning host values into it; a host tensor's indexing is
# checked on its own: _check_host_indexing), and what only compares metadata.
_MIXING_ALLOWED = {torch.Tensor.copy_, _TO, _CUDA, _CPU, *_INDEXING, torch.Tensor.new_tensor,
                   torch.Tensor.data.__set__, torch._has_compatible_shallow_copy_type}


def _tensors(args, kwargs) -> list[torch.Tensor]:
    """The tensors among the call's arguments (and in lists of them, as torch.cat takes)."""
    found = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def _transfer_target(func, args, kwargs) -> tuple[bool, str | None]:
    """(whether the call moves a tensor between devices, the placement asked for)."""
    if func is _CUDA:
        return True, DEVICE
    if func is _CPU:
        return True, HOST
    if func is _TO:
        device = kwargs.get("device")
        if device is None and len(args) > 1 and isinstance(args[1], (torch.device, str, int)) \
                and not isinstance(args[1], bool):
            device = args[1]
        if device is not None:
            return True, _placement_asked(device)
    return False, None


_unchecked = threading.local()


@contextlib.contextmanager
def unchecked():
    """Runs a library's CPU-only code unchecked: an in-process vLLM engine on CPU builds its inputs
    on the host where its GPU code path puts them on the device; that path is not ours to check."""
    depth = getattr(_unchecked, "depth", 0)
    _unchecked.depth = depth + 1
    try:
        yield
    finally:
        _unchecked.depth = depth


def _index_tensors(index) -> list[torch.Tensor]:
    """The tensors of an index (`x[index]`) that index by value: integer arrays and masks. A 0-dim
    tensor indexes as the int (or bool) it holds, read on the host on a GPU too."""
    parts = index if isinstance(index, (tuple, list)) else (index,)
    return [t for t in parts if isinstance(t, torch.Tensor) and t.dim() > 0]


def _check_host_indexing(func, args) -> None:
    """`host[index]` and `host[index] = values` where a GPU refuses them: indices (or a mask) on
    the device for a host tensor; values on the device put through index tensors (index_put_,
    which takes other-device values only as a 0-dim scalar; a slice or an int is a copy)."""
    by_value = _index_tensors(args[1])
    if any(placement(t) == DEVICE for t in by_value):
        _refuse("a host tensor indexed by a GPU tensor of indices or a GPU mask (move the index to the host, "
                "or the tensor to the device)")
    if func is torch.Tensor.__setitem__ and by_value and isinstance(args[2], torch.Tensor) \
            and placement(args[2]) == DEVICE and args[2].dim() > 0:
        _refuse("GPU values put into a host tensor through an index tensor or a mask (move the values to "
                "the host first: .cpu())")


def check_and_mark(func, args, kwargs, call):
    """The discipline around one torch call: refuse what a GPU would, run it (`call()`), mark its
    outputs. A move to the device (or back to the host) copies, as it does on a GPU."""
    if getattr(_unchecked, "depth", 0):
        return call()
    inputs = _tensors(args, kwargs)
    marks = [placement(t) for t in inputs]
    if func in _INDEXING and placement(args[0]) == HOST:
        _check_host_indexing(func, args)
    if func in _NUMPY and marks and marks[0] == DEVICE:
        _refuse(".numpy() of a tensor that lives on the GPU (copy it to the host first: .cpu())")
    if DEVICE in marks and func not in _MIXING_ALLOWED:
        hosts = [t for t, m in zip(inputs, marks) if m == HOST and t.dim() > 0]
        if hosts:
            _refuse(f"{getattr(func, '__name__', func)} mixes a GPU tensor with a host tensor of shape "
                    f"{list(hosts[0].shape)} (move it with .to(compute_device()), or the GPU one to the host)")
    moves, target = _transfer_target(func, args, kwargs)
    out = call()
    if moves:
        source = marks[0] if marks else None
        if out is args[0] and source != target:
            # A real copy on a GPU, and here too: the source keeps its own placement. (A move to
            # a torch.device("cpu") object is one to an unknown placement: see _placement_asked.)
            out = out.clone()
        if target is not None:
            _mark(out, target)
        return out
    if "device" in kwargs and kwargs["device"] is not None:
        target = _placement_asked(kwargs["device"])
    elif DEVICE in marks:
        target = DEVICE
    elif inputs and all(m == HOST for m in marks):
        target = HOST
    elif not inputs:
        target = HOST  # a factory with no device: the host, on a GPU too
    if target is not None:
        for value in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(value, torch.Tensor):
                _mark(value, target)
    return out


_REDUCE_EX = torch.Tensor.__reduce_ex__


def _reduce_ex_under_discipline(self, proto):
    """Pickling a device tensor sends its bytes through the host (and rebuilds it on the sender's
    device index in the receiver); torch.save to a file is fine, and handles to it
    (torch.multiprocessing's reductions) do not come here."""
    if placement(self) == DEVICE and not any(f.filename.endswith("torch/serialization.py")
                                             for f in traceback.extract_stack()):
        _refuse("a tensor that lives on the GPU is pickled for another process (hand it over by "
                "handle, rollout/handoff.py, or move it to the host first)")
    return _REDUCE_EX(self, proto)


_active = False


def active() -> bool:
    return _active


def install() -> None:
    """The process-wide part of the discipline (its per-call part runs in cpu_compat's mode)."""
    global _active
    torch.Tensor.__reduce_ex__ = _reduce_ex_under_discipline
    _active = True

"""Run megatron-core's CUDA-only spots on CPU: the one place that adapts megatron to a GPU-less host.

Active only when no CUDA device is present. It (1) maps every CUDA device request
(`device="cuda"`, `torch.cuda.current_device()`, `.cuda()`) to the CPU through a
TorchFunctionMode, in every thread, (2) answers megatron's `param.type() == 'torch.cuda.FloatTensor'`
checks (optimizer, grad clipping) as a GPU would, (3) replaces the CUDA RNG tracker
with one over CPU generator states (and the CUDA generator's state, which activation recompute
saves and restores, with nothing: the CPU generator's is saved beside it), and (4) makes
`torch.cuda.synchronize` a no-op.
Apart from the CUDA mapping, `allow_moe_without_transformer_engine` fills the one name megatron's
MoE router reads from Transformer-Engine without defining it when TE is missing (CPU, or a GPU
with the local spec). `MEGATRON_TOUCHPOINTS` lists the megatron internals this relies on; a test checks
that they still exist so a megatron upgrade fails loudly instead of silently.
"""
from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

from rlfactory_megatron.runtime import device_discipline

_ENABLED = False
_LOCK = threading.Lock()

# (module, attribute) pairs that this adaptation patches or whose CUDA use it covers.
MEGATRON_TOUCHPOINTS: tuple[tuple[str, str], ...] = (
    ("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker"),
    ("megatron.core.tensor_parallel.random", "_CUDA_RNG_STATE_TRACKER"),
    ("megatron.core.tensor_parallel.random", "_CUDA_RNG_STATE_TRACKER_INITIALIZED"),
    ("megatron.core.tensor_parallel.random", "get_cuda_rng_tracker"),
    ("megatron.core.tensor_parallel.random", "model_parallel_cuda_manual_seed"),
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"),
    ("megatron.core.utils", "GlobalMemoryBuffer"),
    ("megatron.core.pipeline_parallel.p2p_communication", "P2PCommunicator"),
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining"),
    ("megatron.core.optimizer.clip_grads", "get_grad_norm_fp32"),
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params"),
    # reads the module global `te_general_gemm`, imported from TE only when TE is installed
    ("megatron.core.transformer.moe.moe_utils", "RouterGatingLinearFunction"),
)


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int means "cuda:<int>" to torch factory functions.
    return isinstance(device, int) and not isinstance(device, bool)


_CPU = torch.device("cpu")
_TENSOR_CUDA = torch.Tensor.cuda
_TENSOR_TYPE = torch.Tensor.type
_TENSOR_TO = torch.Tensor.to
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _on_cpu(func, args, kwargs):
    """`func(*args, **kwargs)` with its CUDA device arguments made CPU ones."""
    if func is _TENSOR_CUDA:
        return args[0]
    if func is _TENSOR_TYPE and len(args) == 1 and not kwargs:
        # megatron asserts params "are" CUDA float tensors; on CPU they are the same dtype.
        name = func(*args)
        return _CUDA_TYPE_NAMES.get(name, name)
    device = kwargs.get("device")
    if device is not None and _is_cuda_device(device):
        kwargs = dict(kwargs, device=_CPU)
    if func is _TENSOR_TO and args[1:] and _is_cuda_device(args[1]):
        args = (args[0], _CPU, *args[2:])
    return func(*args, **kwargs)


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU for every torch call made while active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return _on_cpu(func, args, kwargs or {})


class DeviceDisciplineMode(TorchFunctionMode):
    """CudaToCpuMode that also keeps the device discipline (runtime/device_discipline.py)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        return device_discipline.check_and_mark(func, args, kwargs, lambda: _on_cpu(func, args, kwargs))


class CpuRNGStatesTracker:
    """Named RNG streams over the CPU generator, with megatron's tracker interface."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise RuntimeError(f"rng seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        generator = torch.Generator().manual_seed(seed)
        self.states_[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        outer_state = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer_state)


def cuda_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def compute_device() -> torch.device:
    """Where this rank's model and its inputs live: the current CUDA device, else the CPU (named
    CUDA under the device discipline, where the CPU stands in for the device)."""
    if cuda_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cuda", 0) if device_discipline.active() else torch.device("cpu")


def enable_cpu_compat() -> bool:
    """Install the adaptation once per process when there is no CUDA device. Returns whether active."""
    global _ENABLED
    if cuda_available():
        return False
    with _LOCK:
        if _ENABLED:
            return True
        import megatron.core.tensor_parallel.random as mcore_random

        check_megatron_touchpoints()
        torch.cuda.current_device = lambda: 0  # mapped to CPU by CudaToCpuMode
        torch.cuda.synchronize = lambda *args, **kwargs: None
        mcore_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
        # Recompute (model.recompute) keeps every RNG state to replay dropout: on CPU
        # the CUDA generator is the CPU one, whose state megatron keeps next to it.
        mcore_random._get_cuda_rng_state = lambda *args, **kwargs: None
        mcore_random._set_cuda_rng_state = lambda *args, **kwargs: None
        # Entered for the rest of the process, in this thread and every thread started from now on
        # (torch's modes are per thread; the rollout loop, the engine step thread and
        # asyncio.to_thread's workers run torch code too).
        mode = CudaToCpuMode
        if device_discipline.requested():
            device_discipline.install()
            mode = DeviceDisciplineMode
        mode().__enter__()
        threading.Thread.run = _running_in(mode, threading.Thread.run)
        _ENABLED = True
    return True


def _running_in(mode: type[TorchFunctionMode], run):
    """`Thread.run` with `mode` entered around it (a thread class that overrides run is not covered)."""
    def run_in_mode(thread: threading.Thread) -> None:
        with mode():
            run(thread)

    return run_in_mode


def allow_moe_without_transformer_engine() -> None:
    """megatron-core 0.16's router forward reads `te_general_gemm`, a name its module defines only
    when TE imports (NameError in every MoE forward without TE; fixed upstream in 0.17). None
    selects its torch matmul path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def check_megatron_touchpoints() -> None:
    """Raise if a megatron-core upgrade moved an internal this adaptation relies on."""
    import importlib

    missing = []
    for module_name, attribute in MEGATRON_TOUCHPOINTS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(module_name)
            continue
        if not hasattr(module, attribute):
            missing.append(f"{module_name}.{attribute}")
    if missing:
        raise RuntimeError(
            "rlfactory_megatron.runtime.cpu_compat: megatron-core internals moved: "
            + ", ".join(missing)
            + ". Pin megatron-core==0.16.1 (requirements/cpu.lock) or update cpu_compat.py."
        )

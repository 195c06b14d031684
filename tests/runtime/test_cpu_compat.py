"""The CPU adaptation of megatron-core: fails loudly when megatron moves what it relies on."""
import subprocess
import sys

import pytest

from rlfactory_megatron.runtime import cpu_compat


def test_every_megatron_touchpoint_exists():
    cpu_compat.check_megatron_touchpoints()


def test_a_moved_touchpoint_is_reported_with_the_fix(monkeypatch):
    moved = cpu_compat.MEGATRON_TOUCHPOINTS + (("megatron.core.utils", "NoSuchBufferAnymore"),)
    monkeypatch.setattr(cpu_compat, "MEGATRON_TOUCHPOINTS", moved)
    with pytest.raises(RuntimeError, match=r"megatron.core.utils.NoSuchBufferAnymore.*megatron-core==0.16.1"):
        cpu_compat.check_megatron_touchpoints()


def test_cuda_requests_land_on_cpu_in_a_fresh_process():
    # A fresh interpreter: the adaptation stays active for the rest of the process once enabled.
    code = """
import torch
from rlfactory_megatron.runtime.cpu_compat import enable_cpu_compat
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
assert enable_cpu_compat()
a = torch.zeros(3, device="cuda"); b = torch.ones(2, device=torch.cuda.current_device()).cuda()
assert a.device.type == b.device.type == "cpu"
assert torch.nn.Parameter(torch.zeros(2)).type() == "torch.cuda.FloatTensor"
tracker = get_cuda_rng_tracker(); tracker.add("model-parallel-rng", 7)
before = torch.get_rng_state()
with tracker.fork():
    x = torch.rand(4)
with tracker.fork():
    y = torch.rand(4)
assert torch.equal(torch.get_rng_state(), before) and not torch.equal(x, y)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_moe_router_runs_without_transformer_engine_in_a_fresh_process():
    # megatron-core 0.16.1 reads te_general_gemm, defined only when TE imports: a NameError in every
    # MoE router forward here until cpu_compat defines it (as None: megatron's torch matmul path).
    code = """
import torch
from megatron.core.transformer.moe.moe_utils import RouterGatingLinearFunction
from rlfactory_megatron.runtime.cpu_compat import allow_moe_without_transformer_engine
inp, weight = torch.randn(3, 8), torch.randn(4, 8)
try:
    RouterGatingLinearFunction.apply(inp, weight, None, torch.float32)
except NameError as exc:
    assert "te_general_gemm" in str(exc)
    print("NameError")
allow_moe_without_transformer_engine()
assert torch.allclose(RouterGatingLinearFunction.apply(inp, weight, None, torch.float32), inp @ weight.t())
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # Upstream fixed it in 0.17: a megatron that no longer raises makes this adaptation removable.
    assert out.stdout.split() == ["NameError", "ok"], out.stdout

"""Triton kernel == PyTorch path, run under TRITON_INTERPRET=1 on CPU in a subprocess.

The interpreter flag must be set before triton is first imported, which a shared pytest
process cannot guarantee; so this module re-runs itself as a script with the flag set.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = [
    # T, V, H, chunk_size, temperature, vocab_size: T not a multiple of the tiles or of the chunk
    (37, 100, 24, 16, 1.0, None),
    (20, 70, 16, 7, 0.7, None),
    (3, 33, 8, 2, 1.0, None),
    (21, 96, 16, 8, 1.0, 77),  # padded vocab: the kernels see only the first 77 rows
]


def _compare_all() -> None:
    import torch

    from logprob_cases import make_inputs, run
    from rlfactory_megatron.kernels import fused_logprob_entropy

    for T, V, H, chunk, temp, vocab_size in CASES:
        hidden, weight, targets, g1, g2 = make_inputs(T, V, H, seed=T)
        inputs = (hidden, weight, targets % (vocab_size or V), g1, g2)
        ref, got = (run(fused_logprob_entropy, *inputs, chunk_size=chunk, temperature=temp, impl=impl, vocab_size=vocab_size)
                    for impl in ("torch", "triton"))
        for name, a, b in zip(("logp", "entropy", "grad_hidden", "grad_weight"), got, ref):
            # Two fp32 summation orders (numpy's BLAS in the interpreter, torch's MKL): on AMD Zen
            # single gradient elements differ by ~1.3e-5; a wrong kernel is off by orders more.
            torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4, msg=lambda m: f"{name} T={T} V={V}: {m}")


@pytest.mark.slow
def test_triton_interpreter_matches_torch():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_triton_kernels_compile_for_hopper(dtype):
    """Ahead-of-time compile to sm_90 PTX/cubin (no GPU needed): catches what the interpreter lets through."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rlfactory_megatron.kernels.logprob import triton_backend

    blocks = dict(BLOCK_T=64, BLOCK_V=128, BLOCK_H=64, PRECISION="ieee" if dtype == "fp32" else "tf32")
    # Pointer, int and float arguments in declaration order (stats are fp64, gradients fp32).
    signatures = {
        triton_backend._stats_kernel: [f"*{dtype}", f"*{dtype}", "*i64"] + ["*fp64"] * 4 + ["i32"] * 7 + ["fp32"],
        triton_backend._grad_logits_kernel: [f"*{dtype}", f"*{dtype}", "*i64"] + ["*fp32"] * 5 + ["i32"] * 6 + ["fp32"],
    }
    for kernel, types in signatures.items():
        names = [n for n in kernel.arg_names if n not in blocks]
        signature = dict(zip(names, types), **{k: "constexpr" for k in blocks})
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=blocks), target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"], kernel.fn.__name__


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    sys.path.insert(0, str(Path(__file__).parent))
    _compare_all()

"""The packed fp32 linear layer (safetensors models and --weights float32 on the CPU): a row's result is the same
bits whatever else is in the call, on oneDNN's AVX-512 and AVX2 kernels."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from minibatch.engine.weights.cpu_linear import PackedLinear, packed_linear_available

pytestmark = pytest.mark.skipif(not packed_linear_available(), reason="oneDNN's packed linear is not available")

SHAPES = [(1152, 576), (3072, 576), (896, 4864), (4096, 896)]  # out x in: the built-in's and Qwen2.5-0.5B's


def rows_invariant() -> None:
    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        lin = PackedLinear(w, b)
        x = torch.randn(64, k, generator=g)
        full = lin(x)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in range(1, 65):
                assert torch.equal(lin(x[:m]), full[:m]), (n, k, m, threads)
            for r in (0, 31, 63):
                assert torch.equal(lin(x[r : r + 1]), full[r : r + 1]), (n, k, r, threads)
        ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
        assert ((full - ref).abs().max() / ref.abs().max()) < 1e-5  # and right


def test_a_row_gets_the_same_bits_in_any_batch():
    before = torch.get_num_threads()
    try:
        rows_invariant()
    finally:
        torch.set_num_threads(before)


def test_the_same_on_onednns_avx2_kernels():
    """An AVX2-only CPU takes other kernels: oneDNN's own switch makes this one take them."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    code = "from tests.engine.test_cpu_linear import rows_invariant; rows_invariant()"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]

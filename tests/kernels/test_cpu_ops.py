"""The C++ small-op kernels (norms, rotary, SiLU-and-mul, the sampler's argmax) against their PyTorch twins in
TorchOps. The fused sampling kernel has its own file, test_sampling.py."""

from __future__ import annotations

import pytest
import torch

from minibatch.engine.models.config import RopeConfig
from minibatch.engine.models.llama import RotaryEmbedding
from minibatch.engine.models.ops import CpuOps, TorchOps
from minibatch.kernels.cpu.extension import load_cpu_extension

ext = load_cpu_extension()
pytestmark = pytest.mark.skipif(ext is None, reason="the C++ extension cannot be built here")


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_rms_norm_and_fused_add(tokens):
    g = torch.Generator().manual_seed(tokens)
    x, res, w = (
        torch.randn(tokens, 576, generator=g),
        torch.randn(tokens, 576, generator=g),
        torch.randn(576, generator=g),
    )
    ops, ref = CpuOps(ext), TorchOps()
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    out, new_res = ops.add_rms_norm(x, res.clone(), w, 1e-5)
    ref_out, ref_res = ref.add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(new_res, ref_res, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)


def test_norm_of_a_strided_view():
    base = torch.randn(7, 960)
    x = base[:, :576]  # a split of a fused projection: rows not contiguous with each other
    w = torch.randn(576)
    torch.testing.assert_close(CpuOps(ext).rms_norm(x, w, 1e-6), TorchOps().rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 9])
def test_rotary_in_place_on_views_of_the_fused_projection(tokens):
    rot = RotaryEmbedding(RopeConfig(theta=100000.0), 64, 512)
    rot.build_tables(torch.device("cpu"))
    qkv = torch.randn(tokens, 9 * 64 + 2 * 3 * 64)
    positions = torch.randint(0, 512, (tokens,))
    q, k, _ = qkv.split([576, 192, 192], dim=-1)
    q, k = q.view(tokens, 9, 64), k.view(tokens, 3, 64)
    want_q, want_k = TorchOps().rotary(positions, q.clone(), k.clone(), rot.cos, rot.sin)
    got_q, got_k = CpuOps(ext).rotary(positions, q, k, rot.cos, rot.sin)
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(qkv[:, :576].view(tokens, 9, 64), want_q, rtol=1e-6, atol=1e-6)  # in place


def test_rotary_refuses_a_position_outside_the_table():
    cos = sin = torch.zeros(16, 32)
    with pytest.raises(RuntimeError, match="position 16 outside the rotary table"):
        CpuOps(ext).rotary(torch.tensor([16]), torch.zeros(1, 2, 64), torch.zeros(1, 1, 64), cos, sin)


@pytest.mark.parametrize("tokens", [1, 33])
def test_silu_mul(tokens):
    gate_up = torch.randn(tokens, 2 * 1536) * 4
    torch.testing.assert_close(CpuOps(ext).silu_mul(gate_up), TorchOps().silu_mul(gate_up), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 40])  # one row serial, the pool's rows, OpenMP's beyond 16
def test_argmax_rows_against_torch(any_build, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 49152, generator=g)
    x[0, 7] = x[0, 900] = x[0].max() + 1  # a tie: the first index wins
    if rows > 1:
        x[1] = float("-inf")  # every value -inf: index 0
    if rows > 2:
        x[2, 5000] = float("nan")  # a NaN counts as the largest
        x[2, 6000] = float("nan")
        x[3, -1] = float("inf")  # at the row's very end
    got = CpuOps(any_build).argmax_rows(x)
    assert got.dtype == torch.long and got.tolist() == TorchOps().argmax_rows(x).tolist()
    assert got[0] == 7 and (rows < 3 or (got[1], got[2], got[3]) == (0, 5000, 49151))


def test_argmax_rows_of_a_strided_view_and_an_odd_width(any_build):
    base = torch.randn(6, 1000)
    x = base[:, 3:994]  # rows apart from each other, 991 values: the vector loop's tail
    x[4, 990] = 50.0  # the largest in the tail
    assert CpuOps(any_build).argmax_rows(x).tolist() == x.argmax(dim=-1).tolist()
    with pytest.raises(RuntimeError, match="at least one value"):
        CpuOps(any_build).argmax_rows(torch.empty(2, 0))

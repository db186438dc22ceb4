"""Every CPU kernel on the default path gives a row the same bits whatever else is in the call.

Each kernel runs on a batch of 64 rows, then on every prefix of it (M = 1 ... 64), on the rows reversed and on
one thread and two: row r's output must be bit for bit the full call's row r. M crosses every path of the
integer matmul (the few-rows groups, the eight-column loop and the tiled many-rows loop, the kernels' own pool
below 16 rows and OpenMP above) on each build (this CPU's, AVX2 without VNNI, portable): a path whose float
operations depended on the rows beside it would fail here. The attention kernel's rule is tested beside it
(test_cpu_paged_attention.py).
"""

from __future__ import annotations

import pytest
import torch

from minibatch.kernels.cpu.extension import load_cpu_extension
from minibatch.kernels.quant_types import INT_DOT_TYPES, QUANT_TYPES

from .quant_blocks import random_blocks

pytestmark = pytest.mark.skipif(load_cpu_extension() is None, reason="the C++ extension cannot be built here")

ROWS = 64


def threads(n: int):
    class _Threads:
        def __enter__(self):
            self.before = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.before)

    return _Threads()


def assert_rows_invariant(fn, x: torch.Tensor) -> None:
    """fn(rows) -> [rows, ...]: each row's output the same bits alone, in every prefix, reversed, on 1 or 2 threads."""
    with threads(2):
        full = fn(x)
    for n in (1, 2):
        with threads(n):
            for m in range(1, x.shape[0] + 1):
                assert torch.equal(fn(x[:m]), full[:m]), f"rows 0..{m - 1} on {n} thread(s)"
            assert torch.equal(fn(x.flip(0)), full.flip(0)), f"reversed on {n} thread(s)"
            for r in (0, 17, x.shape[0] - 1):
                assert torch.equal(fn(x[r : r + 1]), full[r : r + 1]), f"row {r} alone on {n} thread(s)"


@pytest.mark.parametrize("name", sorted(INT_DOT_TYPES))
@pytest.mark.parametrize("n", [200, 61])  # whole groups of eight columns, and some left over
def test_integer_linear(any_build, name, n):
    qtype = QUANT_TYPES[name]
    k = 512 if qtype.block_elems == 256 else 320
    blocks = random_blocks(qtype, n, k, seed=n)
    x = torch.randn(ROWS, k, generator=torch.Generator().manual_seed(n))

    def linear(rows):
        return any_build.quant_linear_q8(
            *any_build.quantize_activations(rows, qtype.block_elems), blocks, qtype.ggml_id
        )

    assert_rows_invariant(linear, x)


@pytest.mark.parametrize("block", [32, 256])
def test_activation_quantization(any_build, block):
    x = torch.randn(ROWS, 512, generator=torch.Generator().manual_seed(block)) * 3
    for i in range(3):
        assert_rows_invariant(lambda rows, i=i: any_build.quantize_activations(rows, block)[i], x)


def test_norms_activation_and_rotary(any_build):
    g = torch.Generator().manual_seed(5)
    hidden, heads, kv_heads, head_dim = 576, 9, 3, 64
    w = torch.randn(hidden, generator=g)
    x, res = torch.randn(ROWS, hidden, generator=g), torch.randn(ROWS, hidden, generator=g)
    assert_rows_invariant(lambda rows: any_build.rms_norm(rows, w, 1e-5), x)

    def add_norm(rows):
        residual = rows[:, hidden:].clone()  # updated in place
        out = any_build.add_rms_norm(rows[:, :hidden].contiguous(), residual, w, 1e-5)
        return torch.cat([out, residual], dim=1)

    assert_rows_invariant(add_norm, torch.cat([x, res], dim=1))
    assert_rows_invariant(any_build.silu_mul, torch.randn(ROWS, 2 * 1536, generator=g))
    cos, sin = torch.randn(512, head_dim // 2, generator=g), torch.randn(512, head_dim // 2, generator=g)
    qk = torch.randn(ROWS, (heads + kv_heads) * head_dim + 1, generator=g)
    qk[:, -1] = torch.randint(0, 512, (ROWS,), generator=g).float()  # each row's position rides along

    def rotary(rows):
        q = rows[:, : heads * head_dim].reshape(-1, heads, head_dim).clone()
        k = rows[:, heads * head_dim : -1].reshape(-1, kv_heads, head_dim).clone()
        any_build.rotary_inplace(rows[:, -1].long().contiguous(), q, k, cos, sin)
        return torch.cat([q.flatten(1), k.flatten(1)], dim=1)

    assert_rows_invariant(rotary, qk)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_1", "Q6_K", "F16"])
def test_embedding(any_build, name):
    qtype = QUANT_TYPES[name]
    k = 512 if qtype.block_elems == 256 else 320
    blocks = random_blocks(qtype, 300, k, seed=2)
    ids = torch.randint(0, 300, (ROWS, 1), generator=torch.Generator().manual_seed(3))
    assert_rows_invariant(lambda rows: any_build.embedding(blocks, qtype.ggml_id, k, rows[:, 0].contiguous()), ids)


@pytest.mark.parametrize("name", sorted(INT_DOT_TYPES))
def test_integer_linear_column_whatever_its_neighbours(any_build, name):
    """A column's bits whatever the matrix around it: the same weight rows as the first 8 of 24 (where the
    AVX-512 build's sixteen-column loop takes them), as 8 alone (its eight-column loop), as the last 8 of 24
    (eight-column again) and as the first 8 of 16 (sixteen-column). (A matrix's last few columns past its groups
    of eight take a one-column loop whose block sums add in another order; which loop that is depends only on
    the matrix's shape, never on the rows in the call.)"""
    qtype = QUANT_TYPES[name]
    k = 512 if qtype.block_elems == 256 else 320
    blocks = random_blocks(qtype, 40, k, seed=11)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(11))
    acts = any_build.quantize_activations(x, qtype.block_elems)

    def out(first, count):
        return any_build.quant_linear_q8(*acts, blocks[first : first + count].contiguous(), qtype.ggml_id)

    whole = out(0, 40)
    for first, count in ((0, 24), (0, 8), (16, 8), (16, 16), (24, 16)):
        assert torch.equal(out(first, count), whole[:, first : first + count]), (first, count)

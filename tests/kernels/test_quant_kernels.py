"""The quantized CPU kernels against their PyTorch twins (gguf.quants' dequantiser + F.linear)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minibatch.kernels.cpu.extension import load_cpu_extension
from minibatch.kernels.cpu.quant import (
    dequantize,
    dequantize_ref,
    embedding,
    quant_linear,
    quant_linear_q8,
    quant_linear_q8_ref,
    quantize_activations,
    quantize_activations_ref,
)
from minibatch.kernels.quant_types import INT_DOT_TYPES, QUANT_TYPES

from .quant_blocks import random_blocks

pytestmark = pytest.mark.skipif(load_cpu_extension() is None, reason="the C++ extension cannot be built here")

TYPES = list(QUANT_TYPES)


def _k(name: str) -> int:
    return 512 if QUANT_TYPES[name].block_elems == 256 else 96  # several blocks per row


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_is_bit_identical_to_gguf(name):
    qtype = QUANT_TYPES[name]
    blocks = random_blocks(qtype, 37, _k(name), seed=1)
    ours, ref = dequantize(blocks, qtype, _k(name)), dequantize_ref(blocks, qtype, _k(name))
    assert ref.abs().max() > 0
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 19, 64])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_matches_dequantised_f_linear(name, rows, threads):
    qtype, k = QUANT_TYPES[name], _k(name)
    n = 61  # odd column count: partial tiles and thread splits
    blocks = random_blocks(qtype, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    ref = F.linear(x, dequantize_ref(blocks, qtype, k))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for gemv_max_rows in (-1, 0, 64):  # the default split, the tiled path alone, the register path alone
            got = quant_linear(x, blocks, qtype, gemv_max_rows)
            err = (got - ref).abs().max() / ref.abs().max()
            assert err < 1e-5, f"{name} rows={rows} gemv_max_rows={gemv_max_rows}: relative error {err:.2e}"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_1", "Q6_K", "F16"])
def test_embedding_dequantises_only_the_rows_asked(name):
    qtype, k = QUANT_TYPES[name], _k(name)
    blocks = random_blocks(qtype, 50, k, seed=3)
    ids = torch.tensor([7, 0, 49, 7, 12])
    assert torch.equal(embedding(blocks, qtype, k, ids), dequantize_ref(blocks, qtype, k)[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        embedding(blocks, qtype, k, torch.tensor([50]))


def test_bad_shapes_are_refused_with_the_numbers():
    qtype = QUANT_TYPES["Q4_1"]
    blocks = random_blocks(qtype, 4, 64)
    with pytest.raises(RuntimeError, match="multiple of the block size 32"):
        quant_linear(torch.randn(1, 48), blocks, qtype)
    with pytest.raises(RuntimeError, match="needs 60"):
        quant_linear(torch.randn(1, 96), blocks, qtype)


# ---- the integer path: 8-bit activations times the weights' integers ----

INT_TYPES = sorted(INT_DOT_TYPES)


@pytest.fixture
def ext(any_build):
    """The extension as built for this CPU, for AVX2 without VNNI, and for x86-64's baseline (conftest.py)."""
    return any_build


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("block", [32, 256])
def test_activation_quantization_is_bit_identical_to_the_twin(ext, rows, block):
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)) * 3
    x[0, :block] = 0.0  # an all-zero block: scale 0, quants 0
    x[-1, block + 8] = 1e-3  # a tiny value beside a block's max
    got, ref = ext.quantize_activations(x, block), quantize_activations_ref(x, block)
    for a, b, name in zip(got, ref, ("q", "d", "bsums")):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    q, d, bsums = ref
    assert d.shape == (rows, 512 // block) and int(q.abs().max()) == 127 and d[0, 0] == 0 and not q[0, :block].any()
    assert torch.equal(bsums.long(), q.long().reshape(rows, 32, 16).sum(-1))


@pytest.mark.parametrize("name", INT_TYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 64, 512])
@pytest.mark.parametrize("threads", [1, 2])
def test_integer_linear_matches_its_twin(ext, name, rows, threads):
    """Against the dequantised weights times the dequantised 8-bit activations, summed in float64: what
    the integer path computes, exactly, up to its fp32 accumulation."""
    qtype, k = QUANT_TYPES[name], _k(name) + (QUANT_TYPES[name].block_elems if rows == 3 else 0)
    n = 61  # odd column count: partial tiles and thread splits
    blocks = random_blocks(qtype, n, k, seed=rows + 7)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    acts = quantize_activations_ref(x, qtype.block_elems)
    ref = quant_linear_q8_ref(acts, blocks, qtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = ext.quant_linear_q8(*acts, blocks, qtype.ggml_id)
    finally:
        torch.set_num_threads(before)
    err = (got - ref).abs().max() / ref.abs().max()
    assert err < 1e-5, f"{name} rows={rows}: relative error {err:.2e}"


# Each 32-value type's largest quants against activations all +-127: where a kernel adds products in int16
# before widening them (AVX2's maddubs sums, eight or four at a time), these are the sums nearest the limit.
# Every byte past a block's scales set to one fill: all bits set gives the largest stored quants (15, 31:
# the unsigned bytes a kernel multiplies), none set the most negative values (-8, -16); Q8_0's -127 and 127.
SCALE_BYTES = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 2, "Q5_1": 4, "Q8_0": 2}
EXTREME_FILLS = [(name, 0xFF) for name in SCALE_BYTES if name != "Q8_0"] + [
    ("Q8_0", 0x80),
    ("Q4_0", 0x00),
    ("Q5_0", 0x00),
    ("Q8_0", 0x81),
    ("Q8_0", 0x7F),
]


@pytest.mark.parametrize(("name", "fill"), EXTREME_FILLS)
@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("rows", [1, 8, 16])
def test_integer_linear_is_exact_at_the_largest_products(ext, name, fill, sign, rows):
    qtype, k, n = QUANT_TYPES[name], 256, 24
    blocks = random_blocks(qtype, n, k, seed=3).reshape(n, k // 32, -1)
    blocks[:, :, SCALE_BYTES[name] :] = fill
    blocks = blocks.reshape(n, -1).contiguous()
    x = torch.full((rows, k), float(sign))
    acts = quantize_activations_ref(x, qtype.block_elems)
    assert int(acts[0].abs().min()) == 127
    ref = quant_linear_q8_ref(acts, blocks, qtype)
    got = ext.quant_linear_q8(*acts, blocks, qtype.ggml_id)
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-6, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS"])
def test_integer_linear_is_close_to_the_exact_path_and_batch_invariant(name):
    qtype, k = QUANT_TYPES[name], 1024
    blocks = random_blocks(qtype, 45, k, seed=2)  # groups of 8 columns and a few past them
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(5))
    exact = quant_linear(x, blocks, qtype)
    fast = quant_linear_q8(quantize_activations(x, qtype.block_elems), blocks, qtype)
    err = ((fast - exact).norm() / exact.norm()).item()
    assert 0 < err < 0.02, err  # 8-bit activations: about 0.5% relative error, never exact
    alone = torch.cat(
        [quant_linear_q8(quantize_activations(x[i : i + 1], qtype.block_elems), blocks, qtype) for i in range(16)]
    )
    assert torch.equal(alone, fast)  # a row's result does not depend on the rows beside it


def test_integer_linear_refuses_float_types_and_bad_shapes():
    acts = quantize_activations(torch.randn(2, 256))
    with pytest.raises(RuntimeError, match="no integer dot product"):
        quant_linear_q8(acts, random_blocks(QUANT_TYPES["F16"], 4, 256), QUANT_TYPES["F16"])
    with pytest.raises(RuntimeError, match="needs 160"):
        quant_linear_q8(acts, random_blocks(QUANT_TYPES["Q4_1"], 4, 96), QUANT_TYPES["Q4_1"])
    with pytest.raises(RuntimeError, match="quantized per 256 values"):
        quant_linear_q8(acts, random_blocks(QUANT_TYPES["Q4_K"], 4, 256), QUANT_TYPES["Q4_K"])

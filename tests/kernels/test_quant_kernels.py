"""The quantized CPU kernels against their PyTorch twins (gguf.quants' dequantiser + F.linear)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minibatch.kernels.cpu_ext import load_cpu_extension
from minibatch.kernels.quant import QUANT_TYPES, dequantize, dequantize_ref, embedding, quant_linear

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

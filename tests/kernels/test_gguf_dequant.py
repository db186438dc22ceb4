"""GGUF blocks dequantised by PyTorch ops where the model lives (kernels/gguf_dequant.py, a GPU's GGUF load)
against gguf.quants (quant.dequantize_ref): every supported type bit for bit, on the CPU's torch device and
on a GPU when there is one, in chunks of rows as large matrices go."""

from __future__ import annotations

import pytest
import torch

from minibatch.kernels import gguf_dequant
from minibatch.kernels.cpu.quant import dequantize_ref
from minibatch.kernels.gguf_dequant import dequantize_torch
from minibatch.kernels.quant_types import QUANT_TYPES

from .quant_blocks import random_blocks

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.float32 and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(QUANT_TYPES))
def test_every_type_dequantises_as_gguf_does(name, device):
    qtype = QUANT_TYPES[name]
    k = 768  # three K-quant super-blocks, 24 blocks of 32
    blocks = random_blocks(qtype, 11, k, seed=len(name))
    got = dequantize_torch(blocks.to(device), qtype, k)
    assert got.device.type == device and got.shape == (11, k)
    assert same_bits(got.cpu(), dequantize_ref(blocks, qtype, k)), name


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "Q6_K"])
def test_rows_in_chunks_give_the_same_values(name, monkeypatch):
    qtype = QUANT_TYPES[name]
    blocks = random_blocks(qtype, 37, 512, seed=4)
    whole = dequantize_torch(blocks, qtype, 512)
    monkeypatch.setattr(gguf_dequant, "CHUNK_BYTES", qtype.row_bytes(512) * 5)  # 5 rows a chunk, 2 left over
    assert same_bits(dequantize_torch(blocks, qtype, 512), whole)


def test_a_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="Q4_K"):
        dequantize_torch(torch.zeros(2, 100, dtype=torch.uint8), QUANT_TYPES["Q4_K"], 256)

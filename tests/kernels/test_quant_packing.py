"""Weights packed by eights for the integer path (csrc/quant_dot_blocks.h's Rows8): the same bytes moved, the
same bits out, on every build (the portable one packs nothing and says so)."""

from __future__ import annotations

import pytest
import torch

from minibatch.engine.weights.quant_linear import QuantEmbedding, QuantLinear
from minibatch.kernels.cpu.quant import (
    embedding,
    pack_rows8_ref,
    quant_linear_q8_ref,
    quantize_activations_ref,
    unpack_rows8_ref,
)
from minibatch.kernels.quant_types import INT_DOT_TYPES, QUANT_TYPES

from .quant_blocks import random_blocks

PACKED32 = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]  # the eight-column kernels' types
PACKED256 = ["Q4_K", "Q5_K", "Q6_K"]  # the eight-column K-quant kernels' types
PACKED = PACKED32 + PACKED256


def _packs(build, name: str) -> bool:
    return build.quant_reads_packed(QUANT_TYPES[name].ggml_id)


def test_which_types_each_build_packs(any_build):
    """The AVX2 builds read the column kernels' types packed and nothing else (AVX-512's, Q6_K as stored); the
    portable one none."""
    packs = {name for name in INT_DOT_TYPES if _packs(any_build, name)}
    kind = any_build.int_path_kind()
    avx512 = set(PACKED) - {"Q6_K"}  # its one-row loop reads Q6_K as stored (quant_dot.cpp's kColumns8K)
    assert packs == (set() if kind == "portable" else avx512 if kind == "avx512-vnni" else set(PACKED))
    if not packs:
        blocks = random_blocks(QUANT_TYPES["Q4_0"], 8, 64, seed=1)
        with pytest.raises(RuntimeError, match="nothing to pack"):
            any_build.quant_pack_rows8(blocks, QUANT_TYPES["Q4_0"].ggml_id)
        acts = quantize_activations_ref(torch.randn(1, 64), 32)
        with pytest.raises(RuntimeError, match="not packed"):
            any_build.quant_linear_q8(*acts, blocks, QUANT_TYPES["Q4_0"].ggml_id, True)


@pytest.mark.parametrize("name", PACKED)
@pytest.mark.parametrize("n", [8, 61, 133])  # whole groups only, and a tail of 5 rows left as stored
def test_packing_is_its_twins_bytes_and_comes_back(any_build, name, n):
    if not _packs(any_build, name):
        pytest.skip("this build reads the type as GGUF stores it")
    qtype = QUANT_TYPES[name]
    blocks = random_blocks(qtype, n, 512, seed=n)
    packed = any_build.quant_pack_rows8(blocks, qtype.ggml_id)
    twin = pack_rows8_ref(blocks, qtype)
    assert torch.equal(packed, twin)
    assert not torch.equal(packed[:8], blocks[:8])  # moved, not copied as they were
    assert torch.equal(packed[n // 8 * 8 :], blocks[n // 8 * 8 :])
    assert torch.equal(unpack_rows8_ref(packed, qtype), blocks)
    ids = torch.tensor([n - 1, 0, 7, min(8, n - 1), n // 2, 3, 3])
    assert torch.equal(any_build.quant_unpack_rows(packed, qtype.ggml_id, ids), blocks[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        any_build.quant_unpack_rows(packed, qtype.ggml_id, torch.tensor([n]))


@pytest.mark.parametrize("name", PACKED)
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 64])
def test_packed_weights_give_the_same_bits(any_build, name, rows):
    """The packed call against the plain one (which packs a copy on the way) and the float64 twin; every row
    alone gives the bits it gives among the others."""
    if not _packs(any_build, name):
        pytest.skip("this build reads the type as GGUF stores it")
    qtype, n, k = QUANT_TYPES[name], 77, 320 if name in PACKED32 else 768
    blocks = random_blocks(qtype, n, k, seed=rows)
    packed = any_build.quant_pack_rows8(blocks, qtype.ggml_id)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    acts = quantize_activations_ref(x, qtype.block_elems)
    got = any_build.quant_linear_q8(*acts, packed, qtype.ggml_id, True)
    assert torch.equal(got, any_build.quant_linear_q8(*acts, blocks, qtype.ggml_id))
    ref = quant_linear_q8_ref(acts, blocks, qtype)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5
    alone = torch.cat(
        [any_build.quant_linear_q8(*(t[i : i + 1] for t in acts), packed, qtype.ggml_id, True) for i in range(rows)]
    )
    assert torch.equal(alone, got)


@pytest.mark.parametrize("name", ["Q8_0", "Q6_K"])
def test_a_tied_head_packs_the_one_copy_its_embedding_reads(name):
    """The output projection tied to the embedding packs the blocks they share, once; the embedding then
    reads its rows out of the packed order and gives the file's values."""
    qtype, vocab, dim = QUANT_TYPES[name], 45, 512
    blocks = random_blocks(qtype, vocab, dim, seed=2)
    emb = QuantEmbedding(blocks.clone(), qtype, dim)
    ids = torch.tensor([0, 44, 9, 40, 9])
    before = emb(ids)
    assert torch.equal(before, embedding(blocks, qtype, dim, ids))
    head = emb.as_linear(int8=True)
    assert emb.blocks is head.blocks and emb.packed == head.packed
    assert torch.equal(emb(ids), before)
    x = torch.randn(3, dim)
    plain = QuantLinear(blocks, qtype, dim, int8=True)
    assert torch.equal(head(x), plain(x))
    exact = QuantLinear(blocks, qtype, dim, int8=False)
    assert not exact.packed and exact.blocks is blocks  # the exact path reads the file's order


# Where each 256-value type's fp16 scales lie in its block; every other byte set gives the largest quants (15,
# 31, 63: the unsigned bytes the kernels multiply) and the int16 sums the kernels add nearest their limit.
HALVES = {"Q4_K": (0, 4), "Q5_K": (0, 4), "Q6_K": (208, 210)}


@pytest.mark.parametrize("name", PACKED256)
@pytest.mark.parametrize("sign", [1, -1])
def test_packed_k_quants_are_exact_at_the_largest_products(any_build, name, sign):
    if not _packs(any_build, name):
        pytest.skip("this build reads the type as GGUF stores it")
    qtype, n, k = QUANT_TYPES[name], 16, 512
    blocks = random_blocks(qtype, n, k, seed=5).reshape(n, k // 256, -1)
    lo, hi = HALVES[name]
    keep = blocks[:, :, lo:hi].clone()
    blocks[:] = 0xFF
    blocks[:, :, lo:hi] = keep
    blocks = blocks.reshape(n, -1).contiguous()
    acts = quantize_activations_ref(torch.full((16, k), float(sign)), 256)
    packed = any_build.quant_pack_rows8(blocks, qtype.ggml_id)
    got = any_build.quant_linear_q8(*acts, packed, qtype.ggml_id, True)
    ref = quant_linear_q8_ref(acts, blocks, qtype)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-6

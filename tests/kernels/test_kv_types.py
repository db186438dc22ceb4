"""The KV cache types on the CPU: each type's store and read against its PyTorch twin on every build (this
CPU's, AVX2 without VNNI, the portable one): f16 and bf16 bit for bit, the block types byte for byte (the twins
against gguf.quants' quantizers, and iq4_nl's against bytes llama.cpp's reference quantizer wrote); attention
over every pair of types against the twin; and the batch-invariance rule on quantized caches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from minibatch.kernels.cpu.paged_attention import load_extension, paged_attention_ref
from minibatch.kernels.kv_types import (
    BLOCK_BYTES,
    IQ4_NL_LEVELS,
    KV_CACHE_TYPES,
    ROTATED_TYPES,
    PagedKV,
    dequantize_ref,
    from_cache_ref,
    hadamard_ref,
    quantize_ref,
    rotation,
    row_width,
    storage_dtype,
    store_ref,
    to_cache_ref,
    type_problem,
)

pytestmark = pytest.mark.skipif(load_extension() is None, reason="the C++ extension cannot be built here")


def values(g, *shape) -> torch.Tensor:
    """Values as K and V have them, with the edge cases a quantizer meets: a block of zeros, ties at .5."""
    x = torch.randn(*shape, generator=g) * 2
    x.view(-1, shape[-1])[0, :32] = 0  # a Q8_0 block whose scale is 0
    x.view(-1, shape[-1])[1, :32] = torch.arange(32) - 15.5  # halves after scaling
    return x


@pytest.mark.parametrize("kv_type", [t for t in BLOCK_BYTES if t != "iq4_nl"])
def test_each_block_twin_is_gguf_quants(kv_type):
    g = torch.Generator().manual_seed(0)
    x = values(g, 40, 256)
    ours = quantize_ref(x, kv_type)
    gguf_type = GGMLQuantizationType[kv_type.upper()]
    theirs = torch.from_numpy(quantize(x.numpy(), gguf_type)).view(40, -1)
    assert torch.equal(ours, theirs)
    q = dequantize_ref(ours, kv_type)
    assert torch.equal(q, torch.from_numpy(np.ascontiguousarray(dequantize(theirs.numpy(), gguf_type))).view(40, 256))
    # the error of a value, in steps d = max |x| / top: half a step (q8_0's symmetric range), a whole one at the
    # other end of q4_0's and q5_0's ranges (-8..7, -16..15: +max is clamped to 7 / 15), plus the fp16 rounding of
    # d (2**-11 of it) times the largest |q|
    top = {"q8_0": 127, "q5_0": 16, "q4_0": 8}
    if kv_type in top:
        blocks, err = x.view(40, 8, 32), (q - x).view(40, 8, 32).abs()
        steps = (0.5 if kv_type == "q8_0" else 1.0) + top[kv_type] / 2048
        assert (err.amax(-1) <= blocks.abs().amax(-1) / top[kv_type] * steps).all()


def iq4_input() -> torch.Tensor:
    i = torch.arange(128, dtype=torch.float32)
    x = torch.sin(i * 0.37) * 3 + torch.cos(i * 1.3) * (i % 7)
    x[64:96] = torch.arange(32) - 15.5
    return x


# What llama.cpp's quantize_row_iq4_nl_ref (its CPU backend's store of an iq4_nl cache) writes for iq4_input().
IQ4_NL_BYTES = (
    "082c584a98f9fdcfabbad8b9391450525426f02ac25a5f5aaafaee6fcac2d9a828139043d72f8090a1a1b1b2c2d3d3d4e4e5f5f6"
    "f7f87baab6d4ecbd6c95f3895d243292870c5771"
)


def test_the_iq4_nl_twin_writes_what_llama_cpp_writes():
    ours = quantize_ref(iq4_input(), "iq4_nl")
    assert ours.dtype == torch.int8 and bytes(ours.view(torch.uint8).numpy()).hex() == IQ4_NL_BYTES
    back = dequantize_ref(ours, "iq4_nl")
    gguf_back = dequantize(np.frombuffer(bytes.fromhex(IQ4_NL_BYTES), np.uint8), GGMLQuantizationType.IQ4_NL)
    assert torch.equal(back, torch.from_numpy(np.ascontiguousarray(gguf_back)).view(128))
    levels = torch.tensor(IQ4_NL_LEVELS, dtype=torch.float32)
    d = ours.view(torch.uint8).view(4, 18)[:, :2].contiguous().view(torch.float16).float()
    assert set(torch.unique((back.view(4, 32) / d).round()).tolist()) <= set(levels.tolist())
    zeros = quantize_ref(torch.zeros(32), "iq4_nl")  # no scale: every index 0 (llama.cpp leaves them as they were)
    assert not zeros.any() and not dequantize_ref(zeros, "iq4_nl").any()


def test_the_rotation_is_orthonormal_its_own_inverse_and_spreads_an_outlier():
    """llama.cpp's Walsh-Hadamard rotation of quantized caches: K in pieces of the largest power of two from 64
    dividing the head, V in pieces of 64, only the 4- and 5-bit types and heads a multiple of 64."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 256, generator=g)
    for n in (64, 128, 256):
        turned = hadamard_ref(x, n)
        torch.testing.assert_close(turned.norm(dim=-1), x.norm(dim=-1))
        torch.testing.assert_close(hadamard_ref(turned, n), x, atol=1e-6, rtol=0)
    assert [rotation("q4_0", d, "k") for d in (64, 128, 192, 256, 96, 80)] == [64, 128, 64, 256, 0, 0]
    assert [rotation(t, 128, "v") for t in ("q4_0", "iq4_nl", "q5_1", "q8_0", "f16")] == [64, 64, 64, 0, 0]
    spike = torch.zeros(64)
    spike[5] = 8.0  # one outlier beside zeros: a block's scale spent on it; turned, 64 values of equal size
    assert torch.equal(hadamard_ref(spike, 64).abs(), torch.ones(64))
    row = torch.randn(64, generator=g) * 0.1
    row[3] = 6.0
    plain = (dequantize_ref(quantize_ref(row, "q4_0"), "q4_0") - row).norm()
    turned = (hadamard_ref(dequantize_ref(store_ref(row, "q4_0", "k"), "q4_0"), 64) - row).norm()
    assert turned < plain / 2


def empty_cache(blocks: int, block_size: int, kv_heads: int, head_dim: int, k_type: str, v_type: str) -> PagedKV:
    return PagedKV(
        *(
            torch.zeros(blocks, block_size, kv_heads, row_width(t, head_dim), dtype=storage_dtype(t))
            for t in (k_type, v_type)
        )
    )


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("kv_type", KV_CACHE_TYPES)
def test_each_build_stores_each_type_as_the_twin_does(any_build, kv_type, head_dim):
    """Rows written by the kernel's store equal the twin's conversion bit for bit (byte for byte for blocks), and
    attention over them equals the twin's over the same rows, at lengths around the block boundaries."""
    g = torch.Generator().manual_seed(head_dim)
    block_size, kv_heads, heads = 16, 2, 4
    scale = head_dim**-0.5  # the model's
    lens = [1, 15, 16, 17, 32, 33]
    width = max(-(-n // block_size) for n in lens)
    cache = empty_cache(len(lens) * width + 1, block_size, kv_heads, head_dim, kv_type, kv_type)
    tables = torch.arange(1, len(lens) * width + 1, dtype=torch.int32).view(len(lens), width)
    slots = torch.tensor(
        [int(tables[s, p // block_size]) * block_size + p % block_size for s, n in enumerate(lens) for p in range(n)]
    )
    n = len(slots)
    q = torch.randn(n, heads, head_dim, generator=g)
    k, v = values(g, n, kv_heads, head_dim), values(g, n, kv_heads, head_dim)
    starts = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = any_build.store_and_attention(q, k, v, cache.k, cache.v, slots, tables, seq_lens, starts, scale, 0, 0.0)
    for stored, new, role in ((cache.k, k, "k"), (cache.v, v, "v")):
        rows = stored.view(-1, kv_heads, stored.shape[-1])[slots]
        assert torch.equal(rows, store_ref(new, kv_type, role))
    ref = paged_attention_ref(q, cache, tables, seq_lens, starts, scale)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    # what attention reads is the stored rows' exact values: a cache of those values in f32 gives the same bits
    # (for a type that keeps rows turned, with the queries turned and the output turned back as the twin does)
    exact = PagedKV(*(from_cache_ref(c, head_dim) for c in cache))
    k_rot, v_rot = rotation(kv_type, head_dim, "k"), rotation(kv_type, head_dim, "v")
    assert (k_rot, v_rot) == ((head_dim, 64) if kv_type in ROTATED_TYPES else (0, 0))
    plain = any_build.paged_attention(hadamard_ref(q, k_rot), exact.k, exact.v, tables, seq_lens, starts, scale, 0, 0.0)
    assert torch.equal(hadamard_ref(plain, v_rot), got)


@pytest.mark.parametrize("k_type", KV_CACHE_TYPES)
@pytest.mark.parametrize("v_type", KV_CACHE_TYPES)
def test_every_pair_of_types_reads_as_the_twin(k_type, v_type):
    """K and V in different types (llama.cpp's -ctk / -ctv): prefills, chunks and decodes in one call."""
    ext = load_extension()
    g = torch.Generator().manual_seed(len(k_type) * 10 + len(v_type))
    block_size, heads, kv_heads, head_dim = 8, 6, 2, 64
    lens, qlens = [40, 1, 23, 70, 9], [40, 1, 5, 33, 1]
    width = max(-(-n // block_size) for n in lens)
    cache = empty_cache(len(lens) * width + 1, block_size, kv_heads, head_dim, k_type, v_type)
    for c, t in zip(cache, (k_type, v_type)):
        c.view(-1, kv_heads, c.shape[-1])[:] = to_cache_ref(values(g, c.shape[0] * block_size, kv_heads, head_dim), t)
    tables = (torch.randperm(len(lens) * width, generator=g) + 1).view(len(lens), width).int()
    starts = torch.tensor([0, *np.cumsum(qlens)], dtype=torch.int32)
    q = torch.randn(int(starts[-1]), heads, head_dim, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = ext.paged_attention(q, cache.k, cache.v, tables, seq_lens, starts, 0.125, 0, 0.0)
    torch.testing.assert_close(
        got, paged_attention_ref(q, cache, tables, seq_lens, starts, 0.125), atol=2e-5, rtol=2e-5
    )


@pytest.mark.parametrize("kv_type", ["f16", "q8_0", "q5_1", "q4_0", "iq4_nl"])
def test_a_query_gets_the_same_bits_however_it_is_computed_on_a_quantized_cache(any_build, kv_type):
    """The batch-invariance rule holds on every type: a token's result is the same in a whole prefill, in a
    chunk, as a decode token and beside other sequences."""
    g = torch.Generator().manual_seed(7)
    block_size, heads, kv_heads, head_dim, n = 16, 9, 3, 64, 45
    cache = empty_cache(10, block_size, kv_heads, head_dim, kv_type, kv_type)
    for c in cache:
        c.view(-1, kv_heads, c.shape[-1])[:] = to_cache_ref(values(g, 10 * block_size, kv_heads, head_dim), kv_type)
    tables = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32)
    q = torch.randn(n, heads, head_dim, generator=g)

    def attend(rows, lens, qlens, table_rows):
        starts = torch.tensor([0, *np.cumsum(qlens)], dtype=torch.int32)
        sub = tables[table_rows].contiguous()
        return any_build.paged_attention(
            rows, cache.k, cache.v, sub, torch.tensor(lens, dtype=torch.int32), starts, 0.125, 0, 0.0
        )

    whole = attend(q, [n], [n], [0])
    for t in (0, 15, 16, 31, 44):
        assert torch.equal(attend(q[t : t + 1], [t + 1], [1], [0]), whole[t : t + 1]), t
    parts = [attend(q[s : s + 7], [min(n, s + 7)], [min(7, n - s)], [0]) for s in range(0, n, 7)]
    assert torch.equal(torch.cat(parts), whole)
    other = torch.randn(3, heads, head_dim, generator=g)
    mixed = attend(torch.cat([other, q[20:]]), [30, n], [3, n - 20], [1, 0])
    assert torch.equal(mixed[3:], whole[20:])


@pytest.mark.parametrize("kv_type", KV_CACHE_TYPES)
def test_a_model_whose_heads_no_block_fits_is_refused_for_every_block_type(kv_type):
    """What minibatchd start says for a model whose heads have 16 values (tests/daemon/test_lifecycle.py starts
    one with q8_0): every block type of 32 values refuses it naming the type and the model's head_dim, and
    the float types keep it."""
    problem = type_problem(kv_type, 16)
    if kv_type in BLOCK_BYTES:
        assert problem == f"{kv_type} needs head_dim a multiple of 32; this model's heads have 16"
        with pytest.raises(ValueError, match=problem):
            row_width(kv_type, 16)
        assert type_problem(kv_type, 64) is None and row_width(kv_type, 64) == 2 * BLOCK_BYTES[kv_type]
    else:
        assert problem is None and row_width(kv_type, 16) == 16


def test_a_cache_the_kernel_cannot_read_is_refused_naming_it():
    ext = load_extension()
    q = torch.randn(1, 2, 48)
    tables, lens, starts = (
        torch.ones(1, 1, dtype=torch.int32),
        torch.ones(1, dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32),
    )
    bad = torch.zeros(2, 16, 1, 51, dtype=torch.uint8)  # q8_0 of 48 values: not a multiple of 32
    with pytest.raises(RuntimeError, match="a K cache of blocks needs head_dim a multiple of 32"):
        ext.paged_attention(q, bad, bad, tables, lens, starts, 0.1, 0, 0.0)
    q64, odd = torch.randn(1, 2, 64), torch.zeros(2, 16, 1, 38, dtype=torch.uint8)  # 19 bytes a block: no type
    with pytest.raises(RuntimeError, match="K cache rows are 38 bytes: not q8_0, q5_1, q5_0, q4_1 or q4_0 blocks"):
        ext.paged_attention(q64, odd, odd, tables, lens, starts, 0.1, 0, 0.0)
    with pytest.raises(RuntimeError, match=r"f32, f16, bf16, uint8 \(q8_0, q5_1, q5_0, q4_1, q4_0\) or int8"):
        ext.paged_attention(
            q,
            torch.zeros(2, 16, 1, 48, dtype=torch.float64),
            torch.zeros(2, 16, 1, 48),
            tables,
            lens,
            starts,
            0.1,
            0,
            0.0,
        )

"""The CPU paged decode kernel against its PyTorch twin: mixed lengths, head ratios, block sizes, random tables."""

from __future__ import annotations

import pytest
import torch

from minibatch.kernels.cpu_paged_attention import load_extension, paged_decode_attention, paged_decode_attention_ref

pytestmark = pytest.mark.skipif(load_extension() is None, reason="the C++ extension cannot be built here")


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (5, 1), (9, 3)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_kernel_matches_the_twin(heads, kv_heads, block_size):
    g = torch.Generator().manual_seed(heads * 100 + kv_heads * 10 + block_size)
    head_dim, num_blocks = 64, 160
    lens = torch.tensor([1, 7, block_size, block_size + 1, 3 * block_size - 1, 130], dtype=torch.int32)
    max_blocks = -(-int(lens.max()) // block_size)
    perm = torch.randperm(num_blocks - 1, generator=g)[: len(lens) * max_blocks] + 1  # block 0 is the null block
    tables = perm.view(len(lens), max_blocks).int()
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    got = paged_decode_attention(q, cache, tables, lens, head_dim**-0.5)
    ref = paged_decode_attention_ref(q, cache, tables, lens, head_dim**-0.5)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 48])  # the register path and the generic one
@pytest.mark.parametrize("window", [1, 5, 8, 20, 1000])
def test_sliding_window_matches_the_twin_and_ignores_what_lies_before_it(window, head_dim):
    g = torch.Generator().manual_seed(window + head_dim)
    block_size, num_blocks = 8, 80
    lens = torch.tensor([1, 7, 8, 9, 23, 61], dtype=torch.int32)
    max_blocks = -(-int(lens.max()) // block_size)
    tables = (
        (torch.randperm(num_blocks - 1, generator=g)[: len(lens) * max_blocks] + 1).view(len(lens), max_blocks).int()
    )
    cache = torch.randn(2, num_blocks, block_size, 2, head_dim, generator=g)
    q = torch.randn(len(lens), 6, head_dim, generator=g)
    got = paged_decode_attention(q, cache, tables, lens, 0.125, window)
    torch.testing.assert_close(
        got, paged_decode_attention_ref(q, cache, tables, lens, 0.125, window), atol=1e-5, rtol=1e-5
    )
    if window < int(lens.max()):
        assert not torch.allclose(got, paged_decode_attention(q, cache, tables, lens, 0.125))  # the window matters
    for s, n in enumerate(lens.tolist()):  # poison every position before each sequence's window
        for pos in range(max(0, n - window)):
            cache[:, tables[s, pos // block_size], pos % block_size] = 1e4
    torch.testing.assert_close(paged_decode_attention(q, cache, tables, lens, 0.125, window), got, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128, 48])  # both register paths and the generic one
@pytest.mark.parametrize("window", [0, 5])
def test_soft_capped_scores_match_the_twin(window, head_dim):
    """Gemma 2: every score becomes cap * tanh(score / cap) before the softmax."""
    g = torch.Generator().manual_seed(window + head_dim)
    block_size, num_blocks = 8, 80
    lens = torch.tensor([1, 7, 9, 23, 61], dtype=torch.int32)
    max_blocks = -(-int(lens.max()) // block_size)
    tables = (
        (torch.randperm(num_blocks - 1, generator=g)[: len(lens) * max_blocks] + 1).view(len(lens), max_blocks).int()
    )
    cache = torch.randn(2, num_blocks, block_size, 2, head_dim, generator=g)
    q = 4 * torch.randn(len(lens), 6, head_dim, generator=g)  # scores well past the cap
    got = paged_decode_attention(q, cache, tables, lens, 0.125, window, 3.0)
    ref = paged_decode_attention_ref(q, cache, tables, lens, 0.125, window, 3.0)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(
        got, paged_decode_attention(q, cache, tables, lens, 0.125, window), atol=1e-2
    )  # it matters


def test_kernel_ignores_table_padding_and_other_blocks():
    cache = torch.randn(2, 10, 8, 2, 16)
    tables = torch.tensor([[3, 0, 0], [4, 5, 6]], dtype=torch.int32)
    lens = torch.tensor([5, 20], dtype=torch.int32)
    q = torch.randn(2, 4, 16)
    before = paged_decode_attention(q, cache, tables, lens, 0.25)
    cache[:, 0] = 1e6  # the null block and unused positions must not matter
    cache[:, 3, 5:] = 1e6
    cache[:, 6, 4:] = 1e6
    torch.testing.assert_close(paged_decode_attention(q, cache, tables, lens, 0.25), before)


def test_store_then_attend_matches_the_twin():
    from minibatch.kernels.cpu_paged_attention import store_and_decode_attention, store_and_decode_attention_ref

    g = torch.Generator().manual_seed(7)
    cache = torch.randn(2, 40, 16, 3, 64, generator=g)
    tables = torch.tensor([[5, 9, 0], [11, 12, 13]], dtype=torch.int32)
    lens = torch.tensor([20, 37], dtype=torch.int32)
    slots = torch.tensor([9 * 16 + 3, 13 * 16 + 4])  # the last position of each sequence
    q, k, v = torch.randn(2, 9, 64, generator=g), torch.randn(2, 3, 64, generator=g), torch.randn(2, 3, 64, generator=g)
    ref_cache = cache.clone()
    got = store_and_decode_attention(q, k, v, cache, slots, tables, lens, 0.125)
    ref = store_and_decode_attention_ref(q, k, v, ref_cache, slots, tables, lens, 0.125)
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)  # the same slots written
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="slot 640 outside the cache"):
        store_and_decode_attention(q, k, v, cache, torch.tensor([640, 1]), tables, lens, 0.125)

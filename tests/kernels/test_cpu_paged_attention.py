"""The CPU paged attention kernel against its PyTorch twin (mixed lengths, head ratios, block sizes, random tables,
decode tokens beside prefills and chunks), and its rule: a query's result is the same bits however it is computed."""

from __future__ import annotations

import pytest
import torch

from minibatch.kernels.cpu.paged_attention import (
    load_extension,
    paged_attention,
    paged_attention_ref,
    paged_decode_attention,
    store_and_attention,
    store_and_attention_ref,
)

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
    ref = paged_attention_ref(q, cache, tables, lens, decode_starts(len(lens)), head_dim**-0.5)
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
        got, paged_attention_ref(q, cache, tables, lens, decode_starts(len(lens)), 0.125, window), atol=1e-5, rtol=1e-5
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
    ref = paged_attention_ref(q, cache, tables, lens, decode_starts(len(lens)), 0.125, window, 3.0)
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
    g = torch.Generator().manual_seed(7)
    cache = torch.randn(2, 40, 16, 3, 64, generator=g)
    tables = torch.tensor([[5, 9, 0], [11, 12, 13]], dtype=torch.int32)
    lens = torch.tensor([20, 37], dtype=torch.int32)
    starts = torch.tensor([0, 1, 4], dtype=torch.int32)  # one decode token, then a chunk of three
    slots = torch.tensor([9 * 16 + 3, 13 * 16 + 2, 13 * 16 + 3, 13 * 16 + 4])  # the last positions
    q, k, v = (torch.randn(4, h, 64, generator=g) for h in (9, 3, 3))
    ref_cache = cache.clone()
    got = store_and_attention(q, k, v, cache, slots, tables, lens, starts, 0.125)
    ref = store_and_attention_ref(q, k, v, ref_cache, slots, tables, lens, starts, 0.125)
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)  # the same slots written
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="slot 640 outside the cache"):
        store_and_attention(q, k, v, cache, torch.tensor([640, 1, 2, 3]), tables, lens, starts, 0.125)
    with pytest.raises(RuntimeError, match="query_start must run from 0"):
        store_and_attention(q, k, v, cache, slots, tables, lens, torch.tensor([0, 1, 3], dtype=torch.int32), 0.125)
    five = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="5 queries over a context of 3"):
        paged_attention(torch.randn(5, 9, 64), cache, tables[:1], torch.tensor([3], dtype=torch.int32), five, 0.1)


def decode_starts(n: int) -> torch.Tensor:
    return torch.arange(n + 1, dtype=torch.int32)


def random_sequences(g, lens: list[int], block_size: int, kv_heads: int, head_dim: int):
    """A cache with every sequence's blocks at random places, and its block tables."""
    width = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * width + 1
    tables = (torch.randperm(num_blocks - 1, generator=g)[: len(lens) * width] + 1).view(len(lens), width).int()
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)
    return cache, tables


@pytest.mark.parametrize("head_dim,window,softcap", [(64, 0, None), (128, 0, None), (48, 0, None), (64, 21, 5.0)])
def test_prefills_chunks_and_decodes_together_match_the_twin(head_dim, window, softcap):
    """Whole prefills, chunks over cached context and decode tokens in one call, against the twin."""
    g = torch.Generator().manual_seed(head_dim + window)
    block_size, heads, kv_heads = 8, 6, 2
    lens, qlens = [40, 1, 23, 70, 9], [40, 1, 5, 33, 1]  # a prefill, a decode, chunks, a decode
    cache, tables = random_sequences(g, lens, block_size, kv_heads, head_dim)
    starts = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(starts[-1]), heads, head_dim, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = paged_attention(q, cache, tables, seq_lens, starts, 0.125, window, softcap)
    ref = paged_attention_ref(q, cache, tables, seq_lens, starts, 0.125, window, softcap)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim,window,softcap", [(64, 0, None), (128, 0, None), (48, 0, None), (64, 13, 4.0)])
def test_a_query_gets_the_same_bits_however_it_is_computed(any_build, head_dim, window, softcap):
    """The kernel's rule: token t of a sequence gives the same bits in a whole prefill, in every chunking of it,
    as a decode token, beside other sequences, anywhere in the batch, on every build."""
    g = torch.Generator().manual_seed(head_dim)
    block_size, heads, kv_heads, n = 16, 9, 3, 75
    cache, tables = random_sequences(g, [n, 50, 33], block_size, kv_heads, head_dim)
    q = torch.randn(n, heads, head_dim, generator=g)
    others = torch.randn(50 + 33, heads, head_dim, generator=g)
    cap = float(softcap or 0)

    def attend(rows, lens, qlens, table_rows):
        starts = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        sub = tables[table_rows].contiguous()
        return any_build.paged_attention(rows, cache[0], cache[1], sub, seq_lens, starts, 0.125, window, cap)

    whole = attend(q, [n], [n], [0])
    for t in range(n):  # each token as a decode step over the cached tokens before it
        assert torch.equal(attend(q[t : t + 1], [t + 1], [1], [0]), whole[t : t + 1]), t
    for chunk in (1, 7, 16, 31):  # chunked prefills over what the earlier chunks cached
        parts = [attend(q[s : s + chunk], [min(n, s + chunk)], [min(chunk, n - s)], [0]) for s in range(0, n, chunk)]
        assert torch.equal(torch.cat(parts), whole), chunk
    # beside a decode token and another sequence's chunk, last in the batch, then first
    mixed = attend(torch.cat([others[:1], others[50:60], q]), [50, 33, n], [1, 10, n], [1, 2, 0])
    assert torch.equal(mixed[11:], whole)
    mixed = attend(torch.cat([q[40:], others[:1]]), [n, 50], [n - 40, 1], [0, 1])
    assert torch.equal(mixed[: n - 40], whole[40:])


@pytest.mark.parametrize("window", [0, 6])
def test_rows_of_whole_images_see_all_of_their_image_on_every_build(any_build, window):
    """Gemma 3's images: a row of an image attends to the image's later positions too (a window still starts
    where it did), the other rows causally; against the twin, and the same bits whether the image's rows come
    with the text before them or after a prefix of cached blocks."""
    g = torch.Generator().manual_seed(window + 1)
    block_size, heads, kv_heads, head_dim = 8, 4, 2, 64
    cache, tables = random_sequences(g, [30, 12], block_size, kv_heads, head_dim)
    q = torch.randn(30 + 1, heads, head_dim, generator=g)
    spans = torch.zeros(31, 2, dtype=torch.int32)
    spans[10:26] = torch.tensor([10, 26], dtype=torch.int32)  # the image: positions 10..25 of the first
    lens, starts = torch.tensor([30, 12], dtype=torch.int32), torch.tensor([0, 30, 31], dtype=torch.int32)

    def attend(rows, lens, starts, spans):
        sub = tables[: len(lens)].contiguous()
        return any_build.paged_attention(rows, cache[0], cache[1], sub, lens, starts, 0.125, window, 0.0, spans)

    got = attend(q, lens, starts, spans)
    ref = paged_attention_ref(q, cache, tables, lens, starts, 0.125, window, None, spans)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    causal = attend(q, lens, starts, None)
    assert not torch.allclose(got[10:25], causal[10:25])  # (the image's rows see past themselves)
    assert torch.equal(got[:10], causal[:10]) and torch.equal(got[26:], causal[26:])  # the others do not
    # the image and what follows it as a chunk over the first 10 positions cached: the same bits
    tail = attend(
        q[10:30], torch.tensor([30], dtype=torch.int32), torch.tensor([0, 20], dtype=torch.int32), spans[10:30]
    )
    assert torch.equal(tail, got[10:30])

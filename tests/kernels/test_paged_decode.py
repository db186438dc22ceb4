"""The split decode attention (kernels/gpu/paged_decode.py) against the PyTorch twin: contexts around the split
size, every KV type, GQA ratios 1-8, windows and soft caps; and the batch-invariance rule: a decode query's
result is the same bits alone, in any batch, and as the same token's row of a prefill."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from minibatch.kernels.gpu.paged_attention import paged_attention, paged_attention_ref  # noqa: E402
from minibatch.kernels.gpu.paged_decode import SPLIT  # noqa: E402
from minibatch.kernels.kv_types import PagedKV, row_width, storage_dtype, to_cache_ref  # noqa: E402

from .conftest import DEVICE, skip_if_gpu_unusable  # noqa: E402
from .test_triton_kernels import TOL  # noqa: E402

skip_if_gpu_unusable()

BLOCK = 16
DIM = 32  # one Q8_0 block per row... and a second one below (64)


def cache_of(kv_type: str, num_blocks: int, kv_heads: int, dim: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=g)
    return to_cache_ref(x, kv_type).to(DEVICE)


def decode_batch(lens, heads, kv_heads, k_type, v_type, qdtype, dim=DIM, seed=0):
    """Decode rows (one query each) over random block tables."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // BLOCK) for n in lens)
    num_blocks = len(lens) * width + 1
    tables = (torch.randperm(num_blocks - 1, generator=g) + 1)[: len(lens) * width].view(len(lens), width).int()
    cache = PagedKV(cache_of(k_type, num_blocks, kv_heads, dim, g), cache_of(v_type, num_blocks, kv_heads, dim, g))
    q = torch.randn(len(lens), heads, dim, generator=g).to(qdtype).to(DEVICE)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32, device=DEVICE)
    return q, cache, tables.to(DEVICE), qsl, torch.tensor(lens, dtype=torch.int32, device=DEVICE)


LENS = [1, SPLIT - 1, SPLIT, SPLIT + 1, 2 * SPLIT + 37]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 2), (8, 2), (8, 1)])  # GQA 1, 2, 3, 4, 8
def test_split_decode_matches_the_twin_around_the_split_size(heads, kv_heads):
    q, cache, tables, qsl, lens = decode_batch(LENS, heads, kv_heads, "f32", "f32", torch.float32, seed=heads)
    got = paged_attention(q, cache, tables, qsl, lens, DIM**-0.5, 1)
    want = paged_attention_ref(q, cache, tables, qsl, lens, DIM**-0.5, 1)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize(
    "k_type,v_type",
    [("f16", "f16"), ("q8_0", "q8_0"), ("q8_0", "f16"), ("f32", "q8_0"), ("q4_1", "iq4_nl"), ("q5_0", "q5_1")]
    + [
        pytest.param(
            "bf16", "bf16", marks=pytest.mark.skipif(DEVICE == "cpu", reason="bf16 is wrong in the interpreter")
        )
    ],
)
def test_split_decode_reads_every_kv_type(k_type, v_type):
    """Block rows read as the twin reads them; 16-bit caches with 16-bit queries; heads of 64 (two blocks)."""
    qdtype = torch.float32
    for t in (k_type, v_type):
        if t in ("f16", "bf16"):
            qdtype = storage_dtype(t)
    q, cache, tables, qsl, lens = decode_batch(LENS, 8, 2, k_type, v_type, qdtype, dim=64, seed=len(k_type + v_type))
    got = paged_attention(q, cache, tables, qsl, lens, 0.125, 1)
    want = paged_attention_ref(q, cache, tables, qsl, lens, 0.125, 1)
    torch.testing.assert_close(got.float(), want.float(), **TOL[qdtype])
    assert row_width(k_type, 64) == cache.k.shape[-1]


@pytest.mark.parametrize("window,softcap", [(0, 30.0), (300, None), (700, 50.0)])
def test_split_decode_windows_and_soft_caps(window, softcap):
    q, cache, tables, qsl, lens = decode_batch(LENS, 4, 2, "f32", "f32", torch.float32, seed=window)
    got = paged_attention(q, cache, tables, qsl, lens, DIM**-0.5, 1, window, softcap)
    want = paged_attention_ref(q, cache, tables, qsl, lens, DIM**-0.5, 1, window, softcap)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [0, 600])
def test_a_decode_query_is_the_same_bits_in_any_batch_and_as_a_prefill_row(dtype, window):
    """The split size is fixed, not chosen by the batch: a query over 1,200 keys is the same bits alone, beside
    short and long neighbours (whose grid has more splits), in a mixed batch beside a prefill chunk, and as
    the last row of the prefill that computed the same token (its splits merged the same way)."""
    g = torch.Generator().manual_seed(7)
    n, heads, kv_heads = 1200, 4, 2
    width = -(-n // BLOCK)
    cache = PagedKV(*(torch.randn(2 * width + 1, BLOCK, kv_heads, DIM, generator=g).to(dtype).to(DEVICE) for _ in "kv"))
    table = (torch.randperm(2 * width, generator=g)[:width] + 1).int()
    other = (torch.randperm(2 * width, generator=g)[:width] + 1).int()
    tables = torch.stack([table, other]).to(DEVICE)
    q = torch.randn(n, heads, DIM, generator=g).to(dtype).to(DEVICE)

    def attend(rows, lens, qlens, table_rows, max_seq_len=None):
        qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
        seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        return paged_attention(
            rows, cache, tables[table_rows].contiguous(), qsl, seq, DIM**-0.5, max(qlens), window,
            max_seq_len=max_seq_len,
        )  # fmt: skip

    alone = attend(q[-1:], [n], [1], [0])
    assert torch.equal(attend(q[-1:], [n], [1], [0], max_seq_len=32768), alone)  # a captured graph's grid
    crowd = attend(torch.cat([q[:1], q[-1:], q[5:6]]), [3, n, n], [1, 1, 1], [1, 0, 1])
    assert torch.equal(crowd[1:2], alone)
    mixed = attend(torch.cat([q[:40], q[-1:]]), [700, n], [40, 1], [1, 0])
    assert torch.equal(mixed[40:], alone)
    prefill = attend(q[-70:], [n], [70], [0])
    assert torch.equal(prefill[-1:], alone)
    torch.testing.assert_close(
        alone.float(), paged_attention_ref(q[-1:], cache, tables[:1], *[
            torch.tensor(v, dtype=torch.int32, device=DEVICE) for v in ([0, 1], [n])
        ], DIM**-0.5, 1, window).float(), **TOL[dtype]
    )  # fmt: skip

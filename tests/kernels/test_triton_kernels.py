"""Every Triton kernel against its PyTorch twin (interpreter on CPU, compiled on a GPU).

Tolerances: fp32 1e-5 (the same math in the same precision, different summation
order); fp16 2e-3 absolute / 1e-2 relative (inputs rounded to 10 mantissa bits,
accumulation in fp32 on both sides); bf16 only on a GPU (2e-2): Triton's
interpreter computes bf16 wrongly on CPU (triton 3.7), so those cases skip there.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from minibatch.kernels.gpu.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402
from minibatch.kernels.gpu.kv_store import store_kv, store_kv_ref  # noqa: E402
from minibatch.kernels.gpu.paged_attention import paged_attention, paged_attention_ref  # noqa: E402
from minibatch.kernels.gpu.rmsnorm import fused_add_rmsnorm, fused_add_rmsnorm_ref  # noqa: E402
from minibatch.kernels.gpu.rotary import rotary_inplace, rotary_inplace_ref  # noqa: E402

from .conftest import DEVICE, skip_if_gpu_unusable  # noqa: E402

skip_if_gpu_unusable()

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=1e-2),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
DTYPES = [
    torch.float32,
    torch.float16,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(DEVICE == "cpu", reason="the Triton interpreter computes bf16 wrongly on CPU"),
    ),
]


def mixed_batch(heads, kv_heads, block_size, dtype, seed):
    """Decode tokens and prefill chunks (some over cached context) in one batch, random block tables."""
    g = torch.Generator().manual_seed(seed)
    head_dim = 16
    query_lens = [1, 1, 5, 12, 3]
    seq_lens = [1, 21, 9, 12, 40]  # context after this step; q_len <= seq_len
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    num_blocks = len(seq_lens) * max_blocks + 3
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    tables = perm[: len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks).int()
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return to(q), to(cache), to(tables), to(qsl), to(torch.tensor(seq_lens, dtype=torch.int32)), max(query_lens)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (5, 1)])
def test_paged_attention_mixed_batch(heads, kv_heads, block_size, dtype):
    q, cache, tables, qsl, lens, max_q = mixed_batch(heads, kv_heads, block_size, dtype, seed=heads + block_size)
    got = paged_attention(q, cache, tables, qsl, lens, 0.25, max_q)
    ref = paged_attention_ref(q, cache, tables, qsl, lens, 0.25, max_q)
    torch.testing.assert_close(got.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [0, 5])
def test_paged_attention_gives_a_query_the_same_bits_however_it_is_computed(dtype, window):
    """A fixed tiling of queries (16) and keys (from position 0): a token's row is the same bits in a whole
    prefill, in any chunk of it, as a decode token and beside other sequences (tiles past its position are
    wholly masked and change nothing)."""
    g = torch.Generator().manual_seed(3)
    block_size, heads, kv_heads, head_dim, n = 8, 4, 2, 16, 37
    tables = torch.tensor([[3, 1, 6, 2, 5], [4, 7, 0, 0, 0]], dtype=torch.int32, device=DEVICE)
    cache = torch.randn(2, 8, block_size, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    q = torch.randn(n, heads, head_dim, generator=g).to(dtype).to(DEVICE)
    other = torch.randn(1, heads, head_dim, generator=g).to(dtype).to(DEVICE)

    def attend(rows, lens, qlens, table_rows):
        qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        return paged_attention(rows, cache, tables[table_rows].contiguous(), qsl, seq_lens, 0.25, max(qlens), window)

    whole = attend(q, [n], [n], [0])
    for t in (0, 7, 15, 16, 17, 36):  # decode tokens, at and around the query tiles' edges
        assert torch.equal(attend(q[t : t + 1], [t + 1], [1], [0]), whole[t : t + 1]), t
    for chunk in (5, 16, 20):
        parts = [attend(q[s : s + chunk], [min(n, s + chunk)], [min(chunk, n - s)], [0]) for s in range(0, n, chunk)]
        assert torch.equal(torch.cat(parts), whole), chunk
    mixed = attend(torch.cat([other, q[9:]]), [12, n], [1, n - 9], [1, 0])
    assert torch.equal(mixed[1:], whole[9:])


@pytest.mark.parametrize("dtype", [torch.float16])
def test_paged_attention_reads_blocks_past_2_31_elements(dtype):
    """A block whose offset (block id x block stride) passes 2**31 elements: int32 offsets would wrap.

    The 8 GiB cache is allocated but only the blocks used are written (untouched
    pages cost no memory), in the interpreter as on a GPU.
    """
    block_size, kv_heads, head_dim = 16, 1, 16
    far = 2**31 // (block_size * kv_heads * head_dim) + 5  # its first element lies past 2**31
    cache = torch.empty(2, far + 2, block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    g = torch.Generator().manual_seed(7)
    for b in (1, far):
        cache[:, b] = torch.randn(2, block_size, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    tables = torch.tensor([[1, far], [far, 1]], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 2, head_dim, generator=g).to(dtype).to(DEVICE)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([27, 32], dtype=torch.int32, device=DEVICE)
    got = paged_attention(q, cache, tables, qsl, lens, 0.25, 1)
    ref = paged_attention_ref(q, cache, tables, qsl, lens, 0.25, 1)
    torch.testing.assert_close(got.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 4, 13])
def test_paged_attention_sliding_window(window, dtype):
    """Decodes and prefill chunks over cached context, each query seeing only its last `window` positions."""
    q, cache, tables, qsl, lens, max_q = mixed_batch(8, 2, 8, dtype, seed=window)
    got = paged_attention(q, cache, tables, qsl, lens, 0.25, max_q, window)
    ref = paged_attention_ref(q, cache, tables, qsl, lens, 0.25, max_q, window)
    torch.testing.assert_close(got.float(), ref.float(), **TOL[dtype])
    full = paged_attention_ref(q, cache, tables, qsl, lens, 0.25, max_q)
    assert not torch.allclose(ref.float(), full.float())  # the window matters for these lengths


@pytest.mark.parametrize("window", [0, 4])
def test_paged_attention_rows_of_whole_images_see_all_of_their_image(window):
    """Gemma 3's images: a row of an image attends to the image's later positions too (a window still starts
    where it did), the other rows causally; decode rows beside them."""
    q, cache, tables, qsl, lens, max_q = mixed_batch(8, 2, 8, torch.float32, seed=11)
    spans = torch.zeros(q.shape[0], 2, dtype=torch.int32)
    spans[10:17] = torch.tensor([3, 10], dtype=torch.int32)  # the 12-token prefill (rows 7..18): positions 3..9
    spans[19:22] = torch.tensor([33, 40], dtype=torch.int32)  # the chunk at 37..39 of an image from 33, cached
    spans = spans.to(DEVICE)
    got = paged_attention(q, cache, tables, qsl, lens, 0.25, max_q, window, image_spans=spans)
    ref = paged_attention_ref(q, cache, tables, qsl, lens, 0.25, max_q, window, image_spans=spans)
    torch.testing.assert_close(got, ref, **TOL[torch.float32])
    causal = paged_attention_ref(q, cache, tables, qsl, lens, 0.25, max_q, window)
    assert not torch.allclose(ref[10:16], causal[10:16])
    plain = paged_attention(q, cache, tables, qsl, lens, 0.25, max_q, window)  # the other rows: the same bits
    assert torch.equal(got[:10], plain[:10]) and torch.equal(got[17:19], plain[17:19])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 4])
def test_paged_attention_soft_capped_scores(window, dtype):
    """Gemma 2: scores -> cap * tanh(scores / cap) before the softmax, with and without a window."""
    q, cache, tables, qsl, lens, max_q = mixed_batch(8, 2, 8, dtype, seed=7)
    q = q * 8  # scores well past the cap, where capping changes the softmax
    got = paged_attention(q, cache, tables, qsl, lens, 0.25, max_q, window, softcap=2.0)
    ref = paged_attention_ref(q, cache, tables, qsl, lens, 0.25, max_q, window, softcap=2.0)
    torch.testing.assert_close(got.float(), ref.float(), **TOL[dtype])
    uncapped = paged_attention_ref(q, cache, tables, qsl, lens, 0.25, max_q, window)
    assert not torch.allclose(ref.float(), uncapped.float(), atol=1e-2)  # the cap matters for these scores


def test_paged_attention_rejects_bad_inputs():
    q, cache, tables, qsl, lens, max_q = mixed_batch(4, 2, 8, torch.float32, 0)
    with pytest.raises(ValueError, match="int32"):
        paged_attention(q, cache, tables.long(), qsl, lens, 0.25, max_q)
    with pytest.raises(ValueError, match="do not fit"):
        paged_attention(q[:, :3], cache, tables, qsl, lens, 0.25, max_q)
    with pytest.raises(ValueError, match="is torch.float16 but the cache"):
        paged_attention(q.half(), cache, tables, qsl, lens, 0.25, max_q)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv(dtype):
    g = torch.Generator().manual_seed(1)
    cache = torch.zeros(2, 6, 8, 2, 16, dtype=dtype, device=DEVICE)
    k = torch.randn(5, 2, 16, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(5, 2, 16, generator=g).to(dtype).to(DEVICE)
    slots = torch.tensor([9, 40, 3, -1, 17], device=DEVICE)  # -1: a padding row, skipped
    ref = cache.clone()
    store_kv(k, v, cache, slots)
    store_kv_ref(k, v, ref, slots)
    assert torch.equal(cache, ref)
    assert cache[0].reshape(-1, 2, 16)[40].equal(k[1]) and cache[1].reshape(-1, 2, 16)[17].equal(v[4])


@pytest.mark.parametrize(
    "k_type,v_type",
    [("q8_0", "q8_0"), ("q8_0", "f16"), ("f16", "q8_0"), ("f16", "f16"), ("q4_0", "iq4_nl"), ("q5_1", "q5_0")]
    + [("q4_1", "f32")],
)
def test_store_and_attention_over_each_cache_type(k_type, v_type):
    """The store writes each type as its twin does (the block types byte for byte: llama.cpp's reference
    quantizers), padding rows skipped; attention reads block rows as the twin does and matches it over the same
    cache. fp32 queries in the interpreter (f16 caches beside f16 queries), heads of 64 (two blocks)."""
    from minibatch.kernels.kv_types import PagedKV, row_width, storage_dtype

    g = torch.Generator().manual_seed(len(k_type) + 3 * len(v_type))
    blocks, bs, kv_heads, heads, dim = 7, 8, 2, 4, 64
    qdtype = torch.float16 if "f16" in (k_type, v_type) else torch.float32
    from minibatch.kernels.kv_types import from_cache_ref

    make = lambda t: torch.zeros(blocks, bs, kv_heads, row_width(t, dim), dtype=storage_dtype(t), device=DEVICE)  # noqa: E731
    cache, ref = PagedKV(make(k_type), make(v_type)), PagedKV(make(k_type), make(v_type))
    lens = [13, 30]
    tables = torch.tensor([[1, 2, 0, 0], [3, 4, 5, 6]], dtype=torch.int32, device=DEVICE)
    slots = [int(tables[s, p // bs]) * bs + p % bs for s, n in enumerate(lens) for p in range(n)]
    slots = torch.tensor(slots[:20] + [-1] + slots[20:], device=DEVICE)  # a padding row among them
    k = (torch.randn(len(slots), kv_heads, dim, generator=g) * 3).to(qdtype).to(DEVICE)
    v = torch.randn(len(slots), kv_heads, dim, generator=g).to(qdtype).to(DEVICE)
    store_kv(k, v, cache, slots)
    store_kv_ref(k, v, ref, slots)
    assert torch.equal(cache.k, ref.k) and torch.equal(cache.v, ref.v)
    for c in cache:  # not all zeros: the stored rows read back near what was written
        assert from_cache_ref(c, dim).abs().amax() > 0.5
    q = torch.randn(sum(lens), heads, dim, generator=g).to(qdtype).to(DEVICE)
    qsl = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device=DEVICE)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    got = paged_attention(q, cache, tables, qsl, seq, dim**-0.5, max(lens))
    want = paged_attention_ref(q, cache, tables, qsl, seq, dim**-0.5, max(lens))
    torch.testing.assert_close(got, want, **TOL[qdtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_fused_add_rmsnorm(dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(7, hidden, generator=g).to(dtype).to(DEVICE)
    res = torch.randn(7, hidden, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(hidden, generator=g).to(dtype).to(DEVICE)
    res_ref = res.clone()
    out = fused_add_rmsnorm(x, res, w, 1e-6)
    ref = fused_add_rmsnorm_ref(x, res_ref, w, 1e-6)
    torch.testing.assert_close(res, res_ref, **TOL[dtype])
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (5, 1)])
def test_rotary_inplace(dtype, heads, kv_heads):
    g = torch.Generator().manual_seed(heads)
    half = 8
    inv = 1.0 / (10000 ** (torch.arange(half).float() / half))
    freqs = torch.arange(64).float()[:, None] * inv[None, :]
    cos, sin = freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
    q = torch.randn(6, heads, 2 * half, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(6, kv_heads, 2 * half, generator=g).to(dtype).to(DEVICE)
    pos = torch.tensor([0, 5, 63, 1, 17, 2], device=DEVICE)
    q2, k2 = q.clone(), k.clone()
    rotary_inplace(q, k, pos, cos, sin)
    rotary_inplace_ref(q2, k2, pos, cos, sin)
    torch.testing.assert_close(q.float(), q2.float(), **TOL[dtype])
    torch.testing.assert_close(k.float(), k2.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [32, 1536])
def test_silu_and_mul(dtype, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(3, 2 * n, generator=g).to(dtype).to(DEVICE)
    torch.testing.assert_close(silu_and_mul(x).float(), silu_and_mul_ref(x).float(), **TOL[dtype])


def test_whole_model_on_the_triton_path_matches_hf(tiny_llama_dir):
    """The tiny Llama forward with Triton attention, KV store, fused norms, rotary and SiLU (interpreter on CPU)."""
    import transformers

    from minibatch.engine.attention.metadata import build_flat_batch
    from minibatch.engine.attention.triton_backend import TritonAttentionBackend
    from minibatch.engine.models.ops import TritonOps
    from minibatch.engine.runner.kv_cache import allocate_kv_cache
    from minibatch.engine.weights.loader import load_model

    ours = load_model(tiny_llama_dir, TritonAttentionBackend(), device=DEVICE, packed=False, ops=TritonOps())
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    seqs = [list(range(3, 3 + n)) for n in (6, 13)]
    tables = [[3, 1], [2, 5, 4, 6]]
    caches = allocate_kv_cache(ours.config, 8, 8, device=DEVICE)

    def hf_last(ids):
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0].float()

    b = build_flat_batch(seqs, [0, 0], tables, 8, DEVICE)
    with torch.no_grad():
        logits = ours.compute_logits(ours(b.input_ids, b.positions, caches, b.attn)).cpu()
    torch.testing.assert_close(logits[:6], hf_last(seqs[0]), atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[6:], hf_last(seqs[1]), atol=1e-4, rtol=0)
    for _ in range(3):  # decode steps: one token each, over the cached context
        nxt = [int(hf_last(s)[-1].argmax()) for s in seqs]
        b = build_flat_batch([[t] for t in nxt], [len(s) for s in seqs], tables, 8, DEVICE)
        with torch.no_grad():
            step = ours.compute_logits(ours(b.input_ids, b.positions, caches, b.attn)).cpu()
        for i, t in enumerate(nxt):
            seqs[i].append(t)
            torch.testing.assert_close(step[i], hf_last(seqs[i])[-1], atol=1e-4, rtol=0)


def test_backend_selection():
    from minibatch.engine.attention.select import select_backend
    from minibatch.engine.attention.torch_backend import TorchAttentionBackend
    from minibatch.engine.attention.triton_backend import TritonAttentionBackend
    from minibatch.engine.models.ops import CpuOps, TorchOps, TritonOps
    from minibatch.kernels.cpu.extension import load_cpu_extension

    backend, ops = select_backend("cuda", torch.bfloat16)
    assert isinstance(backend, TritonAttentionBackend) and isinstance(ops, TritonOps)
    backend, ops = select_backend("cpu", torch.float32)
    cpu_ops = CpuOps if load_cpu_extension() is not None else TorchOps  # the C++ kernels, where they build
    assert isinstance(backend, TorchAttentionBackend) and type(ops) is cpu_ops
    backend, ops = select_backend("cpu", torch.float16)
    assert isinstance(backend, TorchAttentionBackend) and backend.kernel is None

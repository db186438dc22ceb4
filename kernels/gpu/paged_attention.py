"""Paged attention for a mixed batch: prefill chunks and single decode tokens in one launch.

Each sequence has `query_len` new tokens (the last `query_len` positions of its
`seq_len`-token context); each attends causally to its whole context, read from
the paged cache through the sequence's block table. Grouped-query heads share a
KV head. Online softmax in fp32. The cache may hold any of kernels/kv_types.py's
types, K and V each its own: a block type's rows are read as fp32 values (each
small integer times the block's fp16 scale, plus its minimum). Any block size that is a power
of two >= 8: keys are processed in tiles of 64 positions (32 for heads of 256, or a
block if larger: paged_rows.key_tile), each position finding its block through the table, in
splits of paged_decode.SPLIT merged as the decode kernel merges them. Optional: a sliding window, and scores soft-capped
(cap * tanh(score / cap), Gemma 2) before the softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..cpu import paged_attention as cpu_paged_attention
from ..kv_types import hadamard_ref, rotation, type_of
from .paged_decode import SPLIT, paged_decode_into
from .paged_rows import ATTENTION_WARPS, attend_tile, key_tile, kind_of, kv_strides


# stride_bt is the block table's width, which follows the batch's longest context from
# step to step: specialising on it (== 1, % 16) would compile new variants mid-serving; nor on window.
@triton.jit(do_not_specialize=["stride_bt", "window", "softcap"])
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    query_start_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    spans_ptr,  # with IMAGES: [num_tokens, 2] int32, a whole image's row's [first, stop) (0, 0: none)
    scale,
    window,  # > 0: a query attends to the last `window` positions only (sliding window); 0: all
    softcap,  # with SOFTCAP: scores -> softcap * tanh(scores / softcap)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    K_KIND: tl.constexpr,
    V_KIND: tl.constexpr,
    SKIP_DECODE: tl.constexpr,  # rows of one query token are paged_decode.py's
    SPLIT: tl.constexpr,
    IMAGES: tl.constexpr,  # some rows are of whole images: they attend to all of their image's positions too
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    qblock = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if (qblock * BLOCK_M < q_len) & ((q_len > 1) | (not SKIP_DECODE)):
        ctx = tl.load(seq_lens_ptr + seq)
        kv_head = head // GROUP
        offs_m = qblock * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        m_valid = offs_m < q_len
        q = tl.load(
            q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
            mask=m_valid[:, None],
            other=0.0,
        )
        q_pos = ctx - q_len + offs_m  # absolute position of each query token
        last = tl.minimum(ctx, ctx - q_len + (qblock + 1) * BLOCK_M)  # keys past this are masked for all rows
        # with a window, keys before the first row's window are masked for all rows: start past them
        first = tl.where(window > 0, tl.maximum(ctx - q_len + qblock * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N, 0)
        if IMAGES:  # an image's rows reach past their own positions (a window still starts where it did)
            img_first = tl.load(spans_ptr + (q_start + offs_m) * 2, mask=m_valid, other=0)
            img_stop = tl.load(spans_ptr + (q_start + offs_m) * 2 + 1, mask=m_valid, other=0)
            last = ctx
        # The keys in splits of SPLIT from position 0, each split's softmax merged as paged_decode.py merges a
        # decode query's: a token's row is the same bits here as when it is decoded (wholly masked tiles and
        # splits change nothing).
        m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_all = tl.zeros([BLOCK_M], tl.float32)
        acc_all = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for s0 in range(first // SPLIT * SPLIT, last, SPLIT):
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
            for start in range(tl.maximum(s0, first), tl.minimum(s0 + SPLIT, last), BLOCK_N):
                k_pos = start + tl.arange(0, BLOCK_N)
                k_valid = k_pos < last
                allowed = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
                if IMAGES:
                    inside = (k_pos[None, :] >= img_first[:, None]) & (k_pos[None, :] < img_stop[:, None])
                    allowed = allowed | (inside & k_valid[None, :])
                allowed = allowed & ((window <= 0) | (k_pos[None, :] > q_pos[:, None] - window))
                m_i, l_i, acc = attend_tile(
                    q, m_i, l_i, acc, allowed, k_pos, k_valid, seq, kv_head, block_tables_ptr, stride_bt,
                    k_cache_ptr, v_cache_ptr, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                    offs_d, scale, softcap, BLOCK_SIZE, FP32_DOT, SOFTCAP, K_KIND, V_KIND,
                )  # fmt: skip
            m_new = tl.maximum(m_all, m_i)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            old = tl.exp(m_all - m_safe)
            new = tl.exp(m_i - m_safe)
            l_all = l_all * old + l_i * new
            acc_all = acc_all * old[:, None] + acc * new[:, None]
            m_all = m_new
        acc = acc_all / tl.where(l_all == 0.0, 1.0, l_all)[:, None]
        tl.store(
            out_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=m_valid[:, None],
        )


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache,  # PagedKV (K, V) or one [2, ...] tensor: each [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the new tokens
    scale: float,
    max_query_len: int,
    window: int = 0,  # sliding window (0: none)
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap) (None: none)
    max_seq_len: int | None = None,  # the longest context (None: read from seq_lens, a sync)
    min_query_len: int = 1,  # > 1: the batch has no decode row
    image_spans: torch.Tensor | None = None,  # [num_tokens, 2] int32 (AttentionMetadata.image_spans)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Rows of one query token (decode) go through paged_decode.py's split kernel, the others through this
    module's; a row takes the same path whatever else is in the batch."""

    _, num_heads, head_dim = q.shape
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _, block_size, num_kv_heads, _ = k_cache.shape
    for c in (k_cache, v_cache):
        try:
            type_of(c, head_dim)  # its row is the width of a type's row of head_dim values
        except ValueError:
            c = None
        if c is None or c.shape[:3] != k_cache.shape[:3]:
            raise ValueError(
                f"K {tuple(k_cache.shape)} {k_cache.dtype} and V {tuple(v_cache.shape)} {v_cache.dtype} caches do "
                f"not fit heads of {head_dim}"
            )
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} heads do not fit {num_kv_heads} KV heads (each KV head serves as many)")
    if block_size < 8 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 8, got {block_size}")
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the last dimension of q and the cache must be contiguous")
    if block_tables.dtype != torch.int32 or query_start_loc.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_tables, query_start_loc and seq_lens must be int32")
    # a float cache is f32 with f32 queries and 16-bit with 16-bit ones; a block type goes with either
    if any(
        (c.dtype == torch.float32) != (q.dtype == torch.float32) for c in (k_cache, v_cache) if c.is_floating_point()
    ):
        raise ValueError(f"q is {q.dtype} but the cache is {k_cache.dtype} / {v_cache.dtype}: f32 goes with f32")
    # the types that keep K or V turned (kv_types.rotation): queries turned as K is, the output turned back
    k_rot, v_rot = (rotation(type_of(c, head_dim), head_dim, role) for c, role in ((k_cache, "k"), (v_cache, "v")))
    if k_rot:
        q = hadamard_ref(q, k_rot).to(q.dtype).contiguous()
    out = torch.empty_like(q)
    decode = min_query_len == 1 and block_size <= SPLIT
    if decode:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max()) if seq_lens.numel() else 1
        paged_decode_into(
            out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, max_seq_len, window, softcap
        )
        if max_query_len == 1:
            return _turned_back(out, v_rot)
    block_m = 16
    block_n = key_tile(block_size, head_dim)
    grid = (seq_lens.numel(), num_heads, triton.cdiv(max_query_len, block_m))
    _paged_attention_kernel[grid](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        image_spans if image_spans is not None else seq_lens,  # (never read without IMAGES)
        scale,
        window,
        float(softcap or 0.0),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *kv_strides(k_cache, v_cache),
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        FP32_DOT=q.dtype == torch.float32,
        SOFTCAP=bool(softcap),
        K_KIND=kind_of(k_cache, head_dim),
        V_KIND=kind_of(v_cache, head_dim),
        SKIP_DECODE=decode,
        SPLIT=SPLIT,
        IMAGES=image_spans is not None,
        num_warps=ATTENTION_WARPS,
    )
    return _turned_back(out, v_rot)


def _turned_back(out: torch.Tensor, v_rot: int) -> torch.Tensor:
    return hadamard_ref(out, v_rot).to(out.dtype) if v_rot else out


def paged_attention_ref(
    q, kv_cache, block_tables, query_start_loc, seq_lens, scale, max_query_len, window=0, softcap=None, image_spans=None
):
    """The PyTorch twin (kernels/cpu/paged_attention.py's, the CPU kernel's too), in this kernel's argument order."""
    return cpu_paged_attention.paged_attention_ref(
        q, kv_cache, block_tables, seq_lens, query_start_loc, scale, window, softcap, image_spans
    )

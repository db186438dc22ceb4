"""Paged attention for the decode rows of a batch (one query token each), split over the keys (flash-decoding).

A sequence's keys are cut into splits of SPLIT positions, counted from position 0, and each (sequence, KV head,
split) is one program: it loads each key and value tile once for every query head of its group (GQA: the
group's heads are the rows of one tl.dot), runs the online softmax over its split, and writes the split's
running max, sum and unnormalised output. A second kernel merges a query's splits in order. The split size is
fixed, not chosen by the batch, so a query's result depends on its own context alone: the same bits alone or
in a batch of 256 (the batch-invariance rule). KV types as kernels/gpu/paged_attention.py reads them (every type of
kernels/kv_types.py), a sliding window and soft-capped scores too; the PyTorch twin is kernels/cpu/paged_attention.py's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_rows import ATTENTION_WARPS, attend_tile, key_tile, kind_of, kv_strides
from .triton_support import next_power_of_2

SPLIT = 512  # keys per split: fixed (a query's result must not depend on the batch); a multiple of every tile


@triton.jit(do_not_specialize=["stride_bt", "window", "softcap"])
def _decode_split_kernel(
    part_out_ptr,  # fp32 [num_tokens, num_heads, max_splits, head_dim]
    part_ml_ptr,  # fp32 [num_tokens, num_heads, max_splits, 2]: each split's max and sum
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    scale,
    window,
    softcap,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    max_splits,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    FP32_DOT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    K_KIND: tl.constexpr,
    V_KIND: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - token
    ctx = tl.load(seq_lens_ptr + seq)
    if (q_len == 1) & (split * SPLIT < ctx):
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, HEAD_DIM)
        g_valid = offs_g < GROUP
        heads = kv_head * GROUP + offs_g
        q = tl.load(
            q_ptr + token * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=g_valid[:, None], other=0.0
        )
        q_pos = ctx - 1
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        first = split * SPLIT
        last = tl.minimum(ctx, first + SPLIT)
        if window > 0:  # tiles wholly before the window are skipped (tile boundaries stay where they were)
            first = tl.maximum(first, tl.maximum(q_pos - window + 1, 0) // BLOCK_N * BLOCK_N)
        for start in range(first, last, BLOCK_N):
            k_pos = start + tl.arange(0, BLOCK_N)
            k_valid = k_pos < last
            allowed = k_valid & ((window <= 0) | (k_pos > q_pos - window))
            m_i, l_i, acc = attend_tile(
                q, m_i, l_i, acc, allowed[None, :], k_pos, k_valid, seq, kv_head, block_tables_ptr, stride_bt,
                k_cache_ptr, v_cache_ptr, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                offs_d, scale, softcap, BLOCK_SIZE, FP32_DOT, SOFTCAP, K_KIND, V_KIND,
            )  # fmt: skip
        row = (token.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * max_splits + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_valid[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_valid)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_valid)


@triton.jit
def _decode_merge_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_out_ptr,
    part_ml_ptr,
    query_start_ptr,
    seq_lens_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    max_splits,
    HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """A decode query's splits merged in order (the same order whatever the batch)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - token
    if q_len == 1:
        n = tl.cdiv(tl.load(seq_lens_ptr + seq), SPLIT)
        offs_d = tl.arange(0, HEAD_DIM)
        base = (token.to(tl.int64) * num_heads + head) * max_splits
        m = tl.full((), float("-inf"), tl.float32)
        lsum = tl.zeros((), tl.float32)
        acc = tl.zeros([HEAD_DIM], tl.float32)
        for s in range(0, n):
            m_s = tl.load(part_ml_ptr + (base + s) * 2)
            l_s = tl.load(part_ml_ptr + (base + s) * 2 + 1)
            a_s = tl.load(part_out_ptr + (base + s) * HEAD_DIM + offs_d)
            m_new = tl.maximum(m, m_s)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            old = tl.exp(m - m_safe)
            new = tl.exp(m_s - m_safe)
            lsum = lsum * old + l_s * new
            acc = acc * old + a_s * new
            m = m_new
        acc = acc / tl.where(lsum == 0.0, 1.0, lsum)
        tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, acc.to(out_ptr.dtype.element_ty))


def paged_decode_into(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]: the decode rows' results are written here
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,  # the grid's bound on any row's context (a captured graph's: its largest)
    window: int,
    softcap: float | None,
) -> None:
    """The rows with one query token: split over their keys, then merged (checked by paged_attention)."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    max_splits = max(1, triton.cdiv(max_seq_len, SPLIT))
    part_out = torch.empty(num_tokens, num_heads, max_splits, head_dim, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(num_tokens, num_heads, max_splits, 2, dtype=torch.float32, device=q.device)
    num_seqs = seq_lens.numel()
    _decode_split_kernel[(num_seqs, num_kv_heads, max_splits)](
        part_out,
        part_ml,
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        window,
        float(softcap or 0.0),
        q.stride(0),
        q.stride(1),
        *kv_strides(k_cache, v_cache),
        block_tables.stride(0),
        max_splits,
        GROUP=group,
        BLOCK_G=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=key_tile(block_size, head_dim),
        SPLIT=SPLIT,
        FP32_DOT=q.dtype == torch.float32,
        SOFTCAP=bool(softcap),
        K_KIND=kind_of(k_cache, head_dim),
        V_KIND=kind_of(v_cache, head_dim),
        num_warps=ATTENTION_WARPS,
    )
    _decode_merge_kernel[(num_seqs, num_heads)](
        out,
        part_out,
        part_ml,
        query_start_loc,
        seq_lens,
        out.stride(0),
        out.stride(1),
        num_heads,
        max_splits,
        HEAD_DIM=head_dim,
        SPLIT=SPLIT,
    )

"""What both attention kernels share: reading the paged cache's rows whatever type they are kept in
(kernels/kv_types.py), the key tiling, and one tile's step of the online softmax."""

from __future__ import annotations

import triton
import triton.language as tl

# Keys per tile of both attention kernels (at least a block): 64 K and 64 V rows in flight per step of the
# loop at heads up to 128 wide, 32 at 256 (8,192 values a tile: compiled for sm_90 at 8 warps, neither kernel
# spills a register, where 64 keys of 256 did); the same tiling in both, so a token's row is the same bits
# prefilled or decoded.
KEY_TILE_VALUES = 8192
ATTENTION_WARPS = 8


def key_tile(block_size: int, head_dim: int) -> int:
    return max(block_size, min(64, KEY_TILE_VALUES // head_dim))


@triton.jit
def load_rows(row_ptrs, offs_d, mask, Q8: tl.constexpr):
    """[BLOCK_N, HEAD_DIM] cache rows as they are stored (f32, f16, bf16), or Q8_0 rows (uint8: each 32 values an
    fp16 scale then 32 int8) as fp32, exactly: q * d."""
    if Q8:
        blk = offs_d // 32
        q = tl.load(row_ptrs[:, None] + (blk * 34 + 2 + offs_d % 32)[None, :], mask=mask[:, None], other=0)
        lo = tl.load(row_ptrs[:, None] + (blk * 34)[None, :], mask=mask[:, None], other=0).to(tl.uint16)
        hi = tl.load(row_ptrs[:, None] + (blk * 34 + 1)[None, :], mask=mask[:, None], other=0).to(tl.uint16)
        d = (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
        return q.to(tl.int8, bitcast=True).to(tl.float32) * d
    else:
        return tl.load(row_ptrs[:, None] + offs_d[None, :], mask=mask[:, None], other=0.0)


@triton.jit
def attend_tile(
    q, m_i, l_i, acc, allowed, k_pos, k_valid, seq, kv_head, block_tables_ptr, stride_bt, k_cache_ptr, v_cache_ptr,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, offs_d, scale, softcap,
    BLOCK_SIZE: tl.constexpr, FP32_DOT: tl.constexpr, SOFTCAP: tl.constexpr, K_Q8: tl.constexpr, V_Q8: tl.constexpr,
):  # fmt: skip
    """One tile of keys in the online softmax of q's rows (both attention kernels: one code, so a token's row is
    the same bits in either): its K and V rows read through the block table, scores scaled (and soft-capped),
    those not `allowed` masked, the running max, sum and output updated. Returns (m_i, l_i, acc)."""
    # int64: block id x block stride passes 2**31 elements in a cache of 4+ GiB per layer (bf16)
    block = tl.load(block_tables_ptr + seq * stride_bt + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
    within = k_pos % BLOCK_SIZE
    k = load_rows(k_cache_ptr + block * stride_kb + within * stride_ks + kv_head * stride_kh, offs_d, k_valid, K_Q8)
    if FP32_DOT:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))  # a q8_0 row's fp32 values, rounded to q's type
    s = s * scale
    if SOFTCAP:  # tanh written out (stable for either sign): no tanh in every Triton backend
        e = tl.exp(-2.0 * tl.abs(s) / softcap)
        t = (1.0 - e) / (1.0 + e)
        s = softcap * tl.where(s < 0, -t, t)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing allowed yet
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = load_rows(v_cache_ptr + block * stride_vb + within * stride_vs + kv_head * stride_vh, offs_d, k_valid, V_Q8)
    if FP32_DOT:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, l_i, acc


def kv_strides(k_cache, v_cache) -> tuple[int, ...]:
    """The caches' block, slot and head strides, in both kernels' argument order."""
    return (*k_cache.stride()[:3], *v_cache.stride()[:3])

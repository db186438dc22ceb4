"""What both attention kernels share: reading the paged cache's rows whatever type they are kept in
(kernels/kv_types.py), the key tiling, and one tile's step of the online softmax."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kv_types import type_of

# A cache type's code in the kernels (a constexpr each for K and V): 0 a float type, read as it is stored.
KIND = {"q8_0": 1, "q5_1": 2, "q5_0": 3, "q4_1": 4, "q4_0": 5, "iq4_nl": 6}

# Keys per tile of both attention kernels (at least a block): 64 K and 64 V rows in flight per step of the
# loop at heads up to 128 wide, 32 at 256 (8,192 values a tile: compiled for sm_90 at 8 warps, neither kernel
# spills a register, where 64 keys of 256 did); the same tiling in both, so a token's row is the same bits
# prefilled or decoded.
KEY_TILE_VALUES = 8192
ATTENTION_WARPS = 8


def key_tile(block_size: int, head_dim: int) -> int:
    return max(block_size, min(64, KEY_TILE_VALUES // head_dim))


def kind_of(cache: torch.Tensor, head_dim: int) -> int:
    """The kernels' code for the type a cache holds (kernels/kv_types.py): a ValueError naming it when none."""
    return KIND.get(type_of(cache, head_dim), 0)


@triton.jit
def _iq4_level(i):
    """IQ4_NL's level i (0..15): kernels/kv_types.py's IQ4_NL_LEVELS."""
    low = tl.where(
        i < 4, tl.where(i < 2, tl.where(i == 0, -127, -104), tl.where(i == 2, -83, -65)),
        tl.where(i < 6, tl.where(i == 4, -49, -35), tl.where(i == 6, -22, -10)),
    )  # fmt: skip
    high = tl.where(
        i < 12, tl.where(i < 10, tl.where(i == 8, 1, 13), tl.where(i == 10, 25, 38)),
        tl.where(i < 14, tl.where(i == 12, 53, 69), tl.where(i == 14, 89, 113)),
    )  # fmt: skip
    return tl.where(i < 8, low, high)


@triton.jit
def _half_at(ptrs, mask):
    """The fp16 at each of ptrs (two bytes, little end first) as fp32."""
    lo = tl.load(ptrs, mask=mask, other=0).to(tl.uint8, bitcast=True).to(tl.uint16)
    hi = tl.load(ptrs + 1, mask=mask, other=0).to(tl.uint8, bitcast=True).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def load_rows(row_ptrs, offs_d, mask, KIND: tl.constexpr):
    """[BLOCK_N, HEAD_DIM] cache rows as fp32 values: a float type as it is stored (KIND 0), a block type's
    q * d (exact: a small integer times an fp16), + m where the type has one (kernels/kv_types.py's layouts)."""
    # (one branch compiled per KIND; no early return: Triton compiles the code after one whatever the constant)
    if KIND == 0:
        x = tl.load(row_ptrs[:, None] + offs_d[None, :], mask=mask[:, None], other=0.0)
    elif KIND == 1:
        m2 = mask[:, None]
        base = row_ptrs[:, None] + (offs_d // 32 * 34)[None, :]
        q8 = tl.load(base + 2 + (offs_d % 32)[None, :], mask=m2, other=0).to(tl.int8, bitcast=True)
        x = q8.to(tl.float32) * _half_at(base, m2)
    else:
        m2 = mask[:, None]
        j = offs_d % 32
        if KIND == 2:
            base = row_ptrs[:, None] + (offs_d // 32 * 24)[None, :]
            qs = base + 8
        elif KIND == 3:
            base = row_ptrs[:, None] + (offs_d // 32 * 22)[None, :]
            qs = base + 6
        elif KIND == 4:
            base = row_ptrs[:, None] + (offs_d // 32 * 20)[None, :]
            qs = base + 4
        else:
            base = row_ptrs[:, None] + (offs_d // 32 * 18)[None, :]
            qs = base + 2
        packed = tl.load(qs + (j % 16)[None, :], mask=m2, other=0).to(tl.uint8, bitcast=True).to(tl.int32)
        q = tl.where((j < 16)[None, :], packed & 15, packed >> 4)
        if KIND == 2 or KIND == 3:  # the fifth bits: bit j of the 32 after the scale(s)
            if KIND == 2:
                high = base + 4
            else:
                high = base + 2
            bits = tl.load(high + (j // 8)[None, :], mask=m2, other=0).to(tl.uint8, bitcast=True).to(tl.int32)
            q = q | (((bits >> (j % 8)[None, :]) & 1) << 4)
        if KIND == 3:
            q = q - 16
        elif KIND == 5:
            q = q - 8
        elif KIND == 6:
            q = _iq4_level(q)
        x = q.to(tl.float32) * _half_at(base, m2)
        if KIND == 2 or KIND == 4:
            x = x + _half_at(base + 2, m2)
    return x


@triton.jit
def attend_tile(
    q, m_i, l_i, acc, allowed, k_pos, k_valid, seq, kv_head, block_tables_ptr, stride_bt, k_cache_ptr, v_cache_ptr,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, offs_d, scale, softcap,
    BLOCK_SIZE: tl.constexpr, FP32_DOT: tl.constexpr, SOFTCAP: tl.constexpr, K_KIND: tl.constexpr, V_KIND: tl.constexpr,
):  # fmt: skip
    """One tile of keys in the online softmax of q's rows (both attention kernels: one code, so a token's row is
    the same bits in either): its K and V rows read through the block table, scores scaled (and soft-capped),
    those not `allowed` masked, the running max, sum and output updated. Returns (m_i, l_i, acc)."""
    # int64: block id x block stride passes 2**31 elements in a cache of 4+ GiB per layer (bf16)
    block = tl.load(block_tables_ptr + seq * stride_bt + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
    within = k_pos % BLOCK_SIZE
    k = load_rows(k_cache_ptr + block * stride_kb + within * stride_ks + kv_head * stride_kh, offs_d, k_valid, K_KIND)
    if FP32_DOT:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))  # a block row's fp32 values, rounded to q's type
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
    v = load_rows(v_cache_ptr + block * stride_vb + within * stride_vs + kv_head * stride_vh, offs_d, k_valid, V_KIND)
    if FP32_DOT:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, l_i, acc


def kv_strides(k_cache, v_cache) -> tuple[int, ...]:
    """The caches' block, slot and head strides, in both kernels' argument order."""
    return (*k_cache.stride()[:3], *v_cache.stride()[:3])

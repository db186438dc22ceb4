"""Write new K/V into the paged cache through a slot mapping (slot = block * block_size + offset), each converted
to its cache's type (f32, f16 or bf16: round to nearest even, as torch's conversions; q8_0: GGUF's reference
quantizer, kernels/kv_types.py's twin byte for byte)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kv_types import row_width, to_cache_ref, type_of
from .triton_support import next_power_of_2


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,  # [num_tokens, num_kv_heads * head_dim]
    k_cache_ptr,
    v_cache_ptr,  # [num_slots, num_kv_heads * head_dim]
    slot_ptr,  # [num_tokens] int64; a negative slot is padding and is skipped
    stride_k,
    stride_v,
    stride_kc,
    stride_vc,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        m = offs < WIDTH
        k = tl.load(k_ptr + t * stride_k + offs, mask=m).to(k_cache_ptr.dtype.element_ty)
        v = tl.load(v_ptr + t * stride_v + offs, mask=m).to(v_cache_ptr.dtype.element_ty)
        tl.store(k_cache_ptr + slot * stride_kc + offs, k, mask=m)
        tl.store(v_cache_ptr + slot * stride_vc + offs, v, mask=m)


@triton.jit
def _store_q8_0_kernel(
    x_ptr,  # [num_tokens, num_kv_heads * head_dim]
    cache_ptr,  # uint8 [num_slots, num_kv_heads * head_dim / 32 * 34]
    slot_ptr,
    stride_x,
    stride_c,
    BLOCKS: tl.constexpr,  # Q8_0 blocks per token (num_kv_heads * head_dim / 32)
    BLOCKS_P2: tl.constexpr,
):
    """GGUF's reference Q8_0 of one token's row: d = max |x| / 127 per 32 values, q = x * (1 / d) rounded half
    away from zero, d kept as fp16 before the 32 int8."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        b = tl.arange(0, BLOCKS_P2)
        i = tl.arange(0, 32)
        m = b < BLOCKS
        x = tl.load(x_ptr + t * stride_x + b[:, None] * 32 + i[None, :], mask=m[:, None], other=0.0).to(tl.float32)
        d = tl.max(tl.abs(x), 1) / 127.0
        inv = tl.where(d == 0.0, 0.0, 1.0 / d)
        y = x * inv[:, None]
        a = tl.abs(y)
        f = tl.floor(a)
        r = f + tl.floor(2.0 * (a - f))  # C's roundf, exactly (a + 0.5 would round twice)
        q = tl.where(y < 0, -r, r).to(tl.int8)
        bits = d.to(tl.float16).to(tl.uint16, bitcast=True)
        row = cache_ptr + slot * stride_c + b * 34
        tl.store(row, (bits & 0xFF).to(tl.uint8), mask=m)
        tl.store(row + 1, (bits >> 8).to(tl.uint8), mask=m)
        tl.store(row[:, None] + 2 + i[None, :], q.to(tl.uint8, bitcast=True), mask=m[:, None])


def store_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache,  # PagedKV (K, V) or one [2, ...] tensor: each [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    for new, c in ((k, k_cache), (v, v_cache)):
        if new.shape != k.shape or c.shape[2:] != (k.shape[1], row_width(type_of(c), k.shape[2])):
            raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match the cache {tuple(c.shape)}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.numel() != k.shape[0]:
        raise ValueError("slot_mapping must be int64 with one slot per token")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the cache must be contiguous")
    width = k.shape[1] * k.shape[2]
    k2, v2 = k.reshape(-1, width), v.reshape(-1, width)
    if k2.stride(1) != 1 or v2.stride(1) != 1:
        raise ValueError("k and v rows must be contiguous")
    quantized = [c.dtype == torch.uint8 for c in (k_cache, v_cache)]
    if any(quantized):  # each cache by its own kernel: a Q8_0 row is not the value row's width
        for x, c in ((k2, k_cache), (v2, v_cache)):
            if not k.shape[0]:
                break
            if c.dtype == torch.uint8:
                cq = c.view(-1, c.shape[2] * c.shape[3])
                blocks = width // 32
                _store_q8_0_kernel[(k.shape[0],)](
                    x, cq, slot_mapping, x.stride(0), cq.stride(0), BLOCKS=blocks, BLOCKS_P2=next_power_of_2(blocks)
                )
            else:
                cf = c.view(-1, width)
                _store_kv_kernel[(k.shape[0],)](
                    x, x, cf, cf, slot_mapping, x.stride(0), x.stride(0), cf.stride(0), cf.stride(0),
                    WIDTH=width, BLOCK=next_power_of_2(width),
                )  # fmt: skip
        return
    kc, vc = k_cache.view(-1, width), v_cache.view(-1, width)
    if k.shape[0]:
        _store_kv_kernel[(k.shape[0],)](
            k2,
            v2,
            kc,
            vc,
            slot_mapping,
            k2.stride(0),
            v2.stride(0),
            kc.stride(0),
            vc.stride(0),
            WIDTH=width,
            BLOCK=next_power_of_2(width),
        )


def store_kv_ref(k, v, kv_cache, slot_mapping) -> None:
    keep = slot_mapping >= 0
    for new, c in zip((k, v), kv_cache):
        rows = to_cache_ref(new[keep].float(), type_of(c))
        c.view(-1, *c.shape[2:])[slot_mapping[keep]] = rows

"""Write new K/V into the paged cache through a slot mapping (slot = block * block_size + offset), each converted
to its cache's type (f32, f16 or bf16: round to nearest even, as torch's conversions)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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


def store_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache,  # PagedKV (K, V) or one [2, ...] tensor: each [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[2:] or v_cache.shape != k_cache.shape:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match the cache {tuple(k_cache.shape)}")
    if not (k_cache.is_floating_point() and v_cache.is_floating_point()):
        raise ValueError(f"the GPU store keeps f32, f16 or bf16 caches, not {k_cache.dtype} / {v_cache.dtype}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.numel() != k.shape[0]:
        raise ValueError("slot_mapping must be int64 with one slot per token")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the cache must be contiguous")
    width = k.shape[1] * k.shape[2]
    k2, v2 = k.reshape(-1, width), v.reshape(-1, width)
    if k2.stride(1) != 1 or v2.stride(1) != 1:
        raise ValueError("k and v rows must be contiguous")
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
    width = k.shape[1] * k.shape[2]
    kv_cache[0].view(-1, width)[slot_mapping[keep]] = k.reshape(-1, width)[keep].to(kv_cache[0].dtype)
    kv_cache[1].view(-1, width)[slot_mapping[keep]] = v.reshape(-1, width)[keep].to(kv_cache[1].dtype)

"""Write new K/V into the paged cache through a slot mapping (slot = block * block_size + offset), each converted
to its cache's type (f32, f16 or bf16: round to nearest even, as torch's conversions; a block type: llama.cpp's
reference quantizer of it, kernels/kv_types.py's twin byte for byte, with no multiply and add fused into one;
the 4- and 5-bit types' rows turned first, kv_types.rotation)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kv_types import BLOCK_BYTES, hadamard_ref, rotation, row_width, store_ref, type_of
from .paged_rows import _iq4_level, kind_of
from .triton_support import NO_FUSED_MULTIPLY_ADD, next_power_of_2


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
def _signed_max(x, i):
    """Each row's value of the largest magnitude, sign kept, the first of equals (llama.cpp's `amax < |v|`)."""
    a = tl.abs(x)
    first = tl.min(tl.where(a == tl.max(a, 1)[:, None], i[None, :], 32), 1)
    return tl.sum(tl.where(i[None, :] == first[:, None], x, 0.0), 1)


@triton.jit
def _put_half(ptrs, x, mask):
    bits = x.to(tl.float16).to(tl.uint16, bitcast=True)
    tl.store(ptrs, (bits & 0xFF).to(tl.uint8), mask=mask)
    tl.store(ptrs + 1, (bits >> 8).to(tl.uint8), mask=mask)


@triton.jit
def _store_blocks_kernel(
    x_ptr,  # [num_tokens, num_kv_heads * head_dim]
    cache_ptr,  # uint8 [num_slots, num_kv_heads * head_dim / 32 * NB]
    slot_ptr,
    stride_x,
    stride_c,
    BLOCKS: tl.constexpr,  # blocks per token (num_kv_heads * head_dim / 32)
    BLOCKS_P2: tl.constexpr,
    KIND: tl.constexpr,  # paged_rows.KIND's code of the type
    NB: tl.constexpr,  # bytes per block
):
    """One token's row as blocks of its type, by llama.cpp's reference quantizer of the type (kernels/kv_types.py's
    quantize_ref, its twin byte for byte): q8_0 d = max |x| / 127, q = x / d rounded half away from zero; q4_0 /
    q5_0 d = the largest-magnitude value / -8 / -16, x / d + 8.5 / 16.5 truncated; q4_1 / q5_1 min..max in 15 /
    31 steps, (x - min) / d + 0.5 truncated; iq4_nl the nearest of 16 levels at d = max / -127, then d refit by
    least squares, its sums taken one value after another as the reference's are."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        b = tl.arange(0, BLOCKS_P2)
        i = tl.arange(0, 32)
        m = b < BLOCKS
        x = tl.load(x_ptr + t * stride_x + b[:, None] * 32 + i[None, :], mask=m[:, None], other=0.0).to(tl.float32)
        row = cache_ptr + slot * stride_c + b * NB
        if KIND == 1:
            d = tl.max(tl.abs(x), 1) / 127.0
            inv = tl.where(d == 0.0, 0.0, 1.0 / d)
            y = x * inv[:, None]
            a = tl.abs(y)
            f = tl.floor(a)
            r = f + tl.floor(2.0 * (a - f))  # C's roundf, exactly (a + 0.5 would round twice)
            q8 = tl.where(y < 0, -r, r).to(tl.int8)
            _put_half(row, d, m)
            tl.store(row[:, None] + 2 + i[None, :], q8.to(tl.uint8, bitcast=True), mask=m[:, None])
        else:
            if KIND == 2 or KIND == 4:  # q5_1, q4_1
                low = tl.min(x, 1)
                if KIND == 2:
                    top = 31
                else:
                    top = 15
                d = (tl.max(x, 1) - low) / top
                inv = tl.where(d == 0.0, 0.0, 1.0 / d)
                q = tl.minimum(((x - low[:, None]) * inv[:, None] + 0.5).to(tl.int32), top)
                _put_half(row + 2, low, m)
            elif KIND == 3 or KIND == 5:  # q5_0, q4_0
                if KIND == 3:
                    half = 16
                else:
                    half = 8
                d = _signed_max(x, i) / -half
                inv = tl.where(d == 0.0, 0.0, 1.0 / d)
                q = tl.minimum((x * inv[:, None] + (half + 0.5)).to(tl.int32), 2 * half - 1)
            else:  # iq4_nl
                top = _signed_max(x, i)
                y = x * (1.0 / (top / -127.0))[:, None]
                upper = tl.zeros([BLOCKS_P2, 32], dtype=tl.int32)  # how many levels are at or below y
                for k in tl.static_range(16):
                    upper += (_iq4_level(tl.full([BLOCKS_P2, 32], k, tl.int32)).to(tl.float32) <= y).to(tl.int32)
                upper = tl.minimum(tl.maximum(upper, 1), 15)
                lo = _iq4_level(upper - 1).to(tl.float32)
                hi = _iq4_level(upper).to(tl.float32)
                q = tl.where(y - lo < hi - y, upper - 1, upper)
                q = tl.where(y <= -127.0, 0, tl.where(y >= 113.0, 15, q))
                level = _iq4_level(q).to(tl.float32)
                w = x * x
                terms_qx = w * level * x
                terms_q2 = w * level * level
                sum_qx = tl.zeros([BLOCKS_P2], dtype=tl.float32)
                sum_q2 = tl.zeros([BLOCKS_P2], dtype=tl.float32)
                for j in tl.static_range(32):  # one value after another (a sum of one term and zeros is exact)
                    sum_qx = sum_qx + tl.sum(tl.where(i[None, :] == j, terms_qx, 0.0), 1)
                    sum_q2 = sum_q2 + tl.sum(tl.where(i[None, :] == j, terms_q2, 0.0), 1)
                d = tl.where(sum_q2 > 0.0, sum_qx / sum_q2, 0.0)
                zero = tl.max(tl.abs(x), 1) < 1e-15
                d = tl.where(zero, 0.0, d)
                q = tl.where(zero[:, None], 0, q)
            _put_half(row, d, m)
            # byte j: value j's low four bits, value j + 16's above them
            jj = tl.arange(0, 16)
            nib = (q & 15)[:, None, :]
            at = i[None, None, :]
            packed = tl.sum(
                tl.where(at == jj[None, :, None], nib, 0) + tl.where(at == jj[None, :, None] + 16, nib << 4, 0), 2
            )
            tl.store(row[:, None] + (NB - 16) + jj[None, :], packed.to(tl.uint8), mask=m[:, None])
            if KIND == 2 or KIND == 3:  # the fifth bits as one little-endian uint32 after the scale(s)
                bits = tl.sum(((q >> 4) & 1).to(tl.int64) << i[None, :].to(tl.int64), 1)
                if KIND == 2:
                    at_h = row + 4
                else:
                    at_h = row + 2
                for k in tl.static_range(4):
                    tl.store(at_h + k, ((bits >> (8 * k)) & 0xFF).to(tl.uint8), mask=m)


def store_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache,  # PagedKV (K, V) or one [2, ...] tensor: each [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    for new, c in ((k, k_cache), (v, v_cache)):
        if new.shape != k.shape or c.shape[2:] != (k.shape[1], row_width(type_of(c, k.shape[2]), k.shape[2])):
            raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match the cache {tuple(c.shape)}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.numel() != k.shape[0]:
        raise ValueError("slot_mapping must be int64 with one slot per token")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the cache must be contiguous")
    width = k.shape[1] * k.shape[2]
    k_rot, v_rot = (rotation(type_of(c, k.shape[2]), k.shape[2], role) for c, role in zip((k_cache, v_cache), "kv"))
    if k_rot or v_rot:  # the types that keep rows turned (kv_types.rotation): turned here, then stored
        k, v = hadamard_ref(k, k_rot).contiguous(), hadamard_ref(v, v_rot).contiguous()
    k2, v2 = k.reshape(-1, width), v.reshape(-1, width)
    if k2.stride(1) != 1 or v2.stride(1) != 1:
        raise ValueError("k and v rows must be contiguous")
    kinds = [kind_of(c, k.shape[2]) for c in (k_cache, v_cache)]
    if any(kinds):  # each cache by its own kernel: a block row is not the value row's width
        for x, c, kind in ((k2, k_cache, kinds[0]), (v2, v_cache, kinds[1])):
            if not k.shape[0]:
                break
            if kind:
                cq = c.view(torch.uint8).view(-1, c.shape[2] * c.shape[3])
                blocks = width // 32
                _store_blocks_kernel[(k.shape[0],)](
                    x, cq, slot_mapping, x.stride(0), cq.stride(0), BLOCKS=blocks, BLOCKS_P2=next_power_of_2(blocks),
                    KIND=kind, NB=BLOCK_BYTES[type_of(c, k.shape[2])], **NO_FUSED_MULTIPLY_ADD,
                )  # fmt: skip
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
    for new, c, role in zip((k, v), kv_cache, "kv"):
        rows = store_ref(new[keep].float(), type_of(c, new.shape[-1]), role)
        c.view(-1, *c.shape[2:])[slot_mapping[keep]] = rows

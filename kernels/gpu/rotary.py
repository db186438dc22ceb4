"""Rotary embedding (rotate-half layout) applied in place to q and k at each token's position."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_support import next_power_of_2


@triton.jit
def _rotary_kernel(
    x_ptr,  # [num_tokens, heads, head_dim]
    pos_ptr,
    cos_ptr,
    sin_ptr,  # positions [num_tokens]; tables [max_position, head_dim // 2]
    stride_t,
    stride_h,
    stride_c,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    m = (offs_h < HEADS)[:, None]
    cos = tl.load(cos_ptr + pos * stride_c + offs_d)[None, :]
    sin = tl.load(sin_ptr + pos * stride_c + offs_d)[None, :]
    base = x_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(base, mask=m, other=0.0)
    x2 = tl.load(base + HALF, mask=m, other=0.0)
    c, s = cos.to(x1.dtype), sin.to(x1.dtype)
    tl.store(base, x1 * c - x2 * s, mask=m)
    tl.store(base + HALF, x2 * c + x1 * s, mask=m)


def rotary_inplace(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos: torch.Tensor,  # [max_position, head_dim // 2] fp32
    sin: torch.Tensor,  # [max_position, head_dim // 2] fp32
) -> None:
    half = q.shape[-1] // 2
    if k.shape[-1] != q.shape[-1] or cos.shape[-1] != half or half & (half - 1):
        raise ValueError(
            f"head_dim {q.shape[-1]} (half a power of two) must match k {k.shape[-1]} and the tables {cos.shape[-1]}"
        )
    if q.stride(-1) != 1 or k.stride(-1) != 1 or not cos.is_contiguous() or not sin.is_contiguous():
        raise ValueError("head_dim must be contiguous")
    for x in (q, k):
        if x.shape[0]:
            _rotary_kernel[(x.shape[0],)](
                x,
                positions,
                cos,
                sin,
                x.stride(0),
                x.stride(1),
                cos.stride(0),
                HEADS=x.shape[1],
                HALF=half,
                BLOCK_H=next_power_of_2(x.shape[1]),
            )


def rotary_inplace_ref(q, k, positions, cos, sin) -> None:
    for x in (q, k):
        c = cos[positions].unsqueeze(1).to(x.dtype)
        s = sin[positions].unsqueeze(1).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))

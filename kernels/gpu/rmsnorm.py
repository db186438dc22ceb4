"""Fused residual add + RMSNorm: residual += x, then out = weight * normalize(residual), in fp32 inside."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_support import next_power_of_2


@triton.jit
def _add_rmsnorm_kernel(
    out_ptr,
    x_ptr,
    res_ptr,
    w_ptr,  # rows of [num_tokens, hidden]; weight [hidden]
    stride_o,
    stride_x,
    stride_r,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0)
    r = tl.load(res_ptr + row * stride_r + offs, mask=m, other=0.0)
    h = x + r
    tl.store(res_ptr + row * stride_r + offs, h, mask=m)
    h32 = h.to(tl.float32)
    var = tl.sum(h32 * h32, 0) / HIDDEN
    normed = (h32 * (1.0 / tl.sqrt(var + eps))).to(h.dtype)
    w = tl.load(w_ptr + offs, mask=m, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, w * normed, mask=m)


def fused_add_rmsnorm(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor,  # [num_tokens, hidden], updated in place to x + residual
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [num_tokens, hidden]
    if x.shape != residual.shape or x.shape[-1] != weight.shape[0] or x.dim() != 2:
        raise ValueError(f"shapes x {tuple(x.shape)}, residual {tuple(residual.shape)}, weight {tuple(weight.shape)}")
    if x.stride(1) != 1 or residual.stride(1) != 1:
        raise ValueError("rows must be contiguous")
    out = torch.empty_like(x)
    if x.shape[0]:
        _add_rmsnorm_kernel[(x.shape[0],)](
            out,
            x,
            residual,
            weight,
            out.stride(0),
            x.stride(0),
            residual.stride(0),
            eps,
            HIDDEN=x.shape[1],
            BLOCK=next_power_of_2(x.shape[1]),
        )
    return out


def fused_add_rmsnorm_ref(x, residual, weight, eps):
    residual.add_(x)
    h = residual.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

"""SiLU-and-multiply: out = silu(x[:, :n]) * x[:, n:] for the SwiGLU MLP (silu in fp32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, stride_o, stride_x, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = col < N
    gate = tl.load(x_ptr + row * stride_x + col, mask=m, other=0.0)
    up = tl.load(x_ptr + row * stride_x + N + col, mask=m, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * stride_o + col, act * up, mask=m)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * n] -> [num_tokens, n]
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [tokens, 2 * n] with contiguous rows, got {tuple(x.shape)}")
    n = x.shape[1] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    block = min(1024, 1 << (n - 1).bit_length())
    if x.shape[0]:
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(n, block))](out, x, out.stride(0), x.stride(0), N=n, BLOCK=block)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up

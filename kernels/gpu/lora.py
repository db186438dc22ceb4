"""LoRA adapters' updates of a projection's rows, several adapters in one batch (Punica's BGMV):
y[i] += sum over the row's adapters k of scale_k * (x[i] A_k^T) B_k^T. One program per row and block of
outputs, each row on its own in one fixed order whatever the batch (a request's tokens alone are its tokens in
any batch); x A^T in fp32 over blocks of the input, the update added to y once. No branch on a row's adapter:
a missing one (-1) or a projection an adapter leaves alone (rank 0) masks every load to zero. The PyTorch twin
is engine/models/ops.py's TorchOps.lora_update; the C++ kernel is kernels/cpu/csrc/lora.cpp."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_IN = 128
BLOCK_OUT = 128


@triton.jit
def _lora_kernel(
    y_ptr,
    x_ptr,
    a_ptr,  # [S, R, IN] fp16
    bt_ptr,  # [S, R, OUT] fp16
    ranks_ptr,  # [S] int32
    slots_ptr,  # [n, K] int32
    scales_ptr,  # [n, K] fp32
    stride_y,
    stride_x,
    IN,
    OUT,
    R,
    K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_IN: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    cmask = cols < OUT
    rr = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_OUT], dtype=tl.float32)
    for k in tl.static_range(K):
        s = tl.load(slots_ptr + row * K + k)
        valid = s >= 0
        slot = tl.where(valid, s, 0)
        rank = tl.where(valid, tl.load(ranks_ptr + slot), 0)
        scale = tl.load(scales_ptr + row * K + k)
        rmask = rr < rank
        t = tl.zeros([BLOCK_R], dtype=tl.float32)
        for i0 in range(0, IN, BLOCK_IN):
            ii = i0 + tl.arange(0, BLOCK_IN)
            imask = ii < IN
            xv = tl.load(x_ptr + row * stride_x + ii, mask=imask, other=0.0).to(tl.float32)
            a = tl.load(
                a_ptr + (slot * R + rr[:, None]) * IN + ii[None, :], mask=rmask[:, None] & imask[None, :], other=0.0
            ).to(tl.float32)
            t += tl.sum(a * xv[None, :], axis=1)
        b = tl.load(
            bt_ptr + (slot * R + rr[:, None]) * OUT + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0
        ).to(tl.float32)
        acc += tl.sum(b * (t * scale)[:, None], axis=0)
    y = tl.load(y_ptr + row * stride_y + cols, mask=cmask, other=0.0)
    tl.store(y_ptr + row * stride_y + cols, (y.to(tl.float32) + acc).to(y.dtype), mask=cmask)


def lora_update(
    y: torch.Tensor,  # [n, out], updated in place
    x: torch.Tensor,  # [n, in]
    a: torch.Tensor,  # [S, R, in] fp16
    bt: torch.Tensor,  # [S, R, out] fp16
    ranks: torch.Tensor,  # int32 [S]
    slots: torch.Tensor,  # int32 [n, K]
    scales: torch.Tensor,  # fp32 [n, K]
) -> torch.Tensor:
    n, out = y.shape
    if x.shape[0] != n or x.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError(
            f"x and y must be [n, in] and [n, out] with contiguous rows, got {tuple(x.shape)}, {tuple(y.shape)}"
        )
    if a.dtype != torch.float16 or bt.dtype != torch.float16 or not (a.is_contiguous() and bt.is_contiguous()):
        raise ValueError("a and bt must be contiguous fp16 [S, R, in] and [S, R, out]")
    if slots.shape != scales.shape or slots.shape[0] != n:
        raise ValueError("slots and scales must be [n, K] for y's rows")
    if n == 0 or a.shape[1] == 0:
        return y
    grid = (n, triton.cdiv(out, BLOCK_OUT))
    block_r = max(16, 1 << (a.shape[1] - 1).bit_length())
    _lora_kernel[grid](
        y, x, a, bt, ranks, slots.contiguous(), scales.contiguous(), y.stride(0), x.stride(0),
        x.shape[1], out, a.shape[1],
        K=slots.shape[1], BLOCK_R=block_r, BLOCK_IN=BLOCK_IN, BLOCK_OUT=BLOCK_OUT,
    )  # fmt: skip
    return y

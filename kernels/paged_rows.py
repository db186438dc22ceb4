"""Reading the paged cache's rows in a Triton kernel, whatever type they are kept in (kernels/kv_types.py)."""

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

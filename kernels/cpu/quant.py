"""Matrix multiplies and lookups straight from GGUF block-quantized weights (CPU).

A quantized weight [N, K] is kept as GGUF stores it: a uint8 tensor
[N, row_bytes], each row K / block_elems blocks. Two ways to multiply by it:

- exact (`quant_linear`, csrc/quant_matmul.cpp): each block is dequantised
  exactly as `gguf.quants` does and multiplied with fp32 activations, so the
  result is the dequantised model's up to fp32 summation order;
- integer (`quantize_activations` + `quant_linear_q8`, csrc/quant_dot.cpp):
  the activations are quantized to 8 bits per weight block (32 values, or
  256 for the K-quants) and multiplied into the weights' integers, as
  llama.cpp does; the result is the dequantised weights times the 8-bit
  activations.

The `*_ref` functions are the PyTorch twins (`gguf.quants.dequantize` + plain
PyTorch) and the test references.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..quant_types import QuantType, check_shape
from .extension import load_cpu_extension


def quant_linear(
    x: torch.Tensor,  # [rows, K] fp32
    qweight: torch.Tensor,  # [N, row_bytes] uint8
    qtype: QuantType,
    gemv_max_rows: int = -1,  # rows at most on the register path (-1: the kernel's default)
) -> torch.Tensor:  # [rows, N] fp32
    ext = load_cpu_extension()
    if ext is None:
        return quant_linear_ref(x, qweight, qtype)
    return ext.quant_linear(x, qweight, qtype.ggml_id, gemv_max_rows)


def dequantize(qweight: torch.Tensor, qtype: QuantType, k: int) -> torch.Tensor:  # -> [N, K] fp32
    ext = load_cpu_extension()
    if ext is None:
        return dequantize_ref(qweight, qtype, k)
    return ext.dequantize(qweight, qtype.ggml_id, k)


def embedding(qweight: torch.Tensor, qtype: QuantType, k: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` ([T] int64) of the quantized table, dequantised: [T, K] fp32."""
    ext = load_cpu_extension()
    if ext is None:
        return embedding_ref(qweight, qtype, k, ids)
    return ext.embedding(qweight, qtype.ggml_id, k, ids)


def quantize_activations(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[rows, K] fp32 -> (q int8 [rows, K], d [rows, K/block], bsums int16 [rows, K/16]): per `block` values
    (the weight type's block: 32, or 256 for the K-quants) d = max|x| / 127 and q = round(x / d), half to even;
    the sum of every 16 quants. Once per layer input, for every matrix of that block size it feeds."""
    ext = load_cpu_extension()
    if ext is None:
        return quantize_activations_ref(x, block)
    q, d, bs = ext.quantize_activations(x, block)
    return q, d, bs


def quant_linear_q8(
    acts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    qweight: torch.Tensor,
    qtype: QuantType,
    packed: bool = False,  # qweight is `pack_rows8`'s
) -> torch.Tensor:  # [rows, N] fp32
    """x W^T in integers, from `quantize_activations(x, qtype.block_elems)` and a block-quantized W."""
    ext = load_cpu_extension()
    if ext is None:
        return quant_linear_q8_ref(acts, unpack_rows8_ref(qweight, qtype) if packed else qweight, qtype)
    return ext.quant_linear_q8(*acts, qweight, qtype.ggml_id, packed)


def pack_rows8(qweight: torch.Tensor, qtype: QuantType) -> torch.Tensor | None:
    """A copy of W [N, row_bytes] with each eight rows packed as this build's integer path reads them
    (`Rows8` in csrc/quant_dot_blocks.h: the same bytes, moved), or None where it reads the type as GGUF
    stores it. Once at load: the eight-column kernel then loads whole registers where it would gather and
    transpose eight rows' blocks on every call."""
    ext = load_cpu_extension()
    if ext is None or not ext.quant_reads_packed(qtype.ggml_id):
        return None
    return ext.quant_pack_rows8(qweight, qtype.ggml_id)


def unpack_rows8(packed: torch.Tensor, qtype: QuantType, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` ([T] int64) of a `pack_rows8` matrix as GGUF stores them: uint8 [T, row_bytes]."""
    ext = load_cpu_extension()
    if ext is None:
        return unpack_rows8_ref(packed, qtype)[ids]
    return ext.quant_unpack_rows(packed, qtype.ggml_id, ids)


# ---- PyTorch twins: gguf's numpy dequantiser, then plain PyTorch ----


def quantize_activations_ref(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, k = x.shape
    if block not in (32, 256) or k % block:
        raise ValueError(f"{k} values per row in blocks of {block}: need a block of 32 or 256 that divides it")
    groups = x.float().reshape(rows, k // block, block)
    d = groups.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(groups * inv[..., None]).clamp(-127, 127).reshape(rows, k)
    bsums = q.reshape(rows, k // 16, 16).sum(-1).to(torch.int16)
    return q.to(torch.int8), d, bsums


# Rows8's and Rows8K's fields per type, in their packed order: ("half", src) an fp16 a lane; ("bits", src) the
# fifth bits of a 32-bit qh, bit t of byte i from bit 4t + i; ("regs", src, n) n registers of four bytes a lane
_ROWS8 = {
    "Q4_0": [("half", 0), ("regs", 2, 4)],
    "Q4_1": [("half", 0), ("half", 2), ("regs", 4, 4)],
    "Q5_0": [("half", 0), ("bits", 2), ("regs", 6, 4)],
    "Q5_1": [("half", 0), ("half", 2), ("bits", 4), ("regs", 8, 4)],
    "Q8_0": [("half", 0), ("regs", 2, 8)],
    "Q4_K": [("half", 0), ("half", 2), ("regs", 4, 3), ("regs", 16, 32)],
    "Q5_K": [("half", 0), ("half", 2), ("regs", 4, 3), ("regs", 16, 8), ("regs", 48, 32)],
    "Q6_K": [("half", 208), ("regs", 192, 4), ("regs", 0, 32), ("regs", 128, 16)],
}


def _rows8_lanes(qtype: QuantType) -> list[int]:  # the row in each lane: the 32-value nibble types even, then odd
    return [0, 2, 4, 6, 1, 3, 5, 7] if qtype.name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1") else list(range(8))


def pack_rows8_ref(qweight: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """The twin of the kernels' packing, in numpy: each whole group of eight rows as Rows8 (Rows8K) lays it
    down, the rows past the last whole group as they were."""
    n, row_bytes = qweight.shape
    g, nb, size = n // 8, row_bytes // qtype.block_bytes, qtype.block_bytes
    s = qweight[: 8 * g].numpy().reshape(g, 8, nb, size)[:, _rows8_lanes(qtype)]  # [group, lane, block, byte]
    parts = []
    for kind, src, *count in _ROWS8[qtype.name]:
        if kind == "half":
            field = s[..., src : src + 2]
        elif kind == "bits":
            qh = np.ascontiguousarray(s[..., src : src + 4]).view("<u4")[..., 0]  # [g, lane, nb]
            bit = (qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1  # bit 4t + i at [..., t, i]
            field = (bit.reshape(g, 8, nb, 8, 4) << np.arange(8, dtype=np.uint32)[:, None]).sum(-2).astype(np.uint8)
        else:  # register r's lane l: bytes src + 4r.. of row l
            regs = count[0]
            field = s[..., src : src + 4 * regs].reshape(g, 8, nb, regs, 4).transpose(0, 2, 3, 1, 4)
            parts.append(field.reshape(g, nb, -1))
            continue
        parts.append(field.transpose(0, 2, 1, 3).reshape(g, nb, -1))
    out = qweight.clone()
    out[: 8 * g] = torch.from_numpy(np.concatenate(parts, -1).reshape(8 * g, row_bytes))
    return out


def unpack_rows8_ref(packed: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """Every row of a packed matrix as GGUF stores it (the inverse of `pack_rows8_ref`)."""
    n, row_bytes = packed.shape
    g, nb, size = n // 8, row_bytes // qtype.block_bytes, qtype.block_bytes
    p = packed[: 8 * g].numpy().reshape(g, nb, 8 * size)
    rows = np.zeros((g, 8, nb, size), np.uint8)  # [group, lane, block, byte]
    at = 0
    for kind, src, *count in _ROWS8[qtype.name]:
        width = 2 if kind == "half" else 4 if kind == "bits" else 4 * count[0]
        field = p[..., at : at + 8 * width]
        at += 8 * width
        if kind == "regs":
            regs = count[0]
            rows[..., src : src + width] = (
                field.reshape(g, nb, regs, 8, 4).transpose(0, 3, 1, 2, 4).reshape(g, 8, nb, width)
            )
            continue
        field = field.reshape(g, nb, 8, width).transpose(0, 2, 1, 3)  # [g, lane, nb, width]
        if kind == "bits":  # bit t of byte i is bit 4t + i of qh
            bit = (field.astype(np.uint32)[..., None, :] >> np.arange(8, dtype=np.uint32)[:, None]) & 1  # [..., t, i]
            qh = (bit.reshape(g, 8, nb, 32) << np.arange(32, dtype=np.uint32)).sum(-1).astype("<u4")
            field = qh[..., None].view(np.uint8)
        rows[..., src : src + width] = field
    out = packed.clone()
    out[: 8 * g] = torch.from_numpy(rows[:, np.argsort(_rows8_lanes(qtype))].reshape(8 * g, row_bytes))
    return out


def quant_linear_q8_ref(
    acts: tuple[torch.Tensor, torch.Tensor, torch.Tensor], qweight: torch.Tensor, qtype: QuantType
) -> torch.Tensor:
    """The dequantised weights times the dequantised 8-bit activations, summed in float64."""
    q, d, _ = acts
    rows, k = q.shape
    block = k // d.shape[1]
    x = (q.double().reshape(rows, k // block, block) * d.double()[..., None]).reshape(rows, k)
    return F.linear(x, dequantize_ref(qweight, qtype, k).double()).float()


def dequantize_ref(qweight: torch.Tensor, qtype: QuantType, k: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    check_shape(qweight, qtype, k)
    raw = qweight.numpy()
    if qtype.name == "F32":
        values = raw.view(np.float32)
    elif qtype.name == "F16":
        values = raw.view(np.float16).astype(np.float32)
    elif qtype.name == "BF16":
        values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        values = gguf_dequantize(raw, GGMLQuantizationType(qtype.ggml_id))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(qweight.shape[0], k))


def quant_linear_ref(x: torch.Tensor, qweight: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    return F.linear(x, dequantize_ref(qweight, qtype, x.shape[1]))


def embedding_ref(qweight: torch.Tensor, qtype: QuantType, k: int, ids: torch.Tensor) -> torch.Tensor:
    return dequantize_ref(qweight[ids], qtype, k)

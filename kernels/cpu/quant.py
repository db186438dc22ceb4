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
    acts: tuple[torch.Tensor, torch.Tensor, torch.Tensor], qweight: torch.Tensor, qtype: QuantType
) -> torch.Tensor:  # [rows, N] fp32
    """x W^T in integers, from `quantize_activations(x, qtype.block_elems)` and a block-quantized W."""
    ext = load_cpu_extension()
    if ext is None:
        return quant_linear_q8_ref(acts, qweight, qtype)
    return ext.quant_linear_q8(*acts, qweight, qtype.ggml_id)


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

"""GGUF blocks dequantised by PyTorch ops on whatever device holds them (a GPU's load of a GGUF model).

Each type's values are computed in fp32 with the operations, and in the order, gguf.quants uses (the same
order kernels/cpu/csrc/quant_matmul.cpp keeps): one rounding per multiply and per add, none fused, so the result
is gguf.quants.dequantize's bit for bit (`quant.dequantize_ref` is the twin). Rows go in chunks, so a large
matrix's transient integers stay within a few hundred megabytes.
"""

from __future__ import annotations

import torch

from .quant_types import QuantType, check_shape

IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
CHUNK_BYTES = 1 << 26  # raw bytes dequantised at once


def _half(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of each block, as fp32 [blocks, 1]."""
    return b[:, at : at + 2].contiguous().view(torch.float16).float()


def _u32(b: torch.Tensor, at: int) -> torch.Tensor:
    """The little-endian uint32 at byte `at` of each block, in int64 [blocks, 1]."""
    w = b[:, at : at + 4].long()
    return w[:, :1] | (w[:, 1:2] << 8) | (w[:, 2:3] << 16) | (w[:, 3:4] << 24)


def _nibbles(qs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = qs.int()
    return q & 0x0F, q >> 4


def _q4_0(b):
    lo, hi = _nibbles(b[:, 2:18])
    return _half(b, 0) * (torch.cat([lo, hi], 1) - 8).float()


def _q4_1(b):
    lo, hi = _nibbles(b[:, 4:20])
    return _half(b, 0) * torch.cat([lo, hi], 1).float() + _half(b, 2)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """Bit j of qh for j in 0..31: [blocks, 32] int32."""
    return ((qh >> torch.arange(32, device=qh.device)) & 1).int()


def _q5_0(b):
    lo, hi = _nibbles(b[:, 6:22])
    q = torch.cat([lo, hi], 1) | (_fifth_bits(_u32(b, 2)) << 4)
    return _half(b, 0) * (q - 16).float()


def _q5_1(b):
    lo, hi = _nibbles(b[:, 8:24])
    q = torch.cat([lo, hi], 1) | (_fifth_bits(_u32(b, 4)) << 4)
    return _half(b, 0) * q.float() + _half(b, 2)


def _q8_0(b):
    return b[:, 2:34].contiguous().view(torch.int8).float() * _half(b, 0)


def _levels(q: torch.Tensor) -> torch.Tensor:
    return torch.tensor(IQ4_LEVELS, dtype=torch.float32, device=q.device)[q.long()]


def _iq4_nl(b):
    lo, hi = _nibbles(b[:, 2:18])
    return _half(b, 0) * _levels(torch.cat([lo, hi], 1))


def _iq4_xs(b):
    n = b.shape[0]
    sh = b[:, 2].int() | (b[:, 3].int() << 8)
    j = torch.arange(8, device=b.device)
    sl = b[:, 4:8].int()[:, j // 2]
    sc = ((sl >> (4 * (j % 2))) & 0x0F) | (((sh[:, None] >> (2 * j)) & 3) << 4)
    dl = _half(b, 0) * (sc - 32).float()  # [n, 8]
    lo, hi = _nibbles(b[:, 8:136].reshape(n, 8, 16))
    return (dl[:, :, None] * _levels(torch.cat([lo, hi], 2))).reshape(n, 256)


def _k_positions(device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For value i = 128c + 32s + l of a Q2_K / Q3_K block: (c, s, l)."""
    i = torch.arange(256, device=device)
    return i // 128, (i // 32) % 4, i % 32


def _q2_k(b):
    c, s, lane = _k_positions(b.device)
    sc = b[:, :16].int()
    dl = _half(b, 80) * (sc & 0x0F).float()
    ml = _half(b, 82) * (sc >> 4).float()
    q = (b[:, 16:80].int()[:, 32 * c + lane] >> (2 * s)) & 3
    g = torch.arange(256, device=b.device) // 16
    return dl[:, g] * q.float() - ml[:, g]


def _q3_k(b):
    c, s, lane = _k_positions(b.device)
    k = torch.arange(16, device=b.device)
    sc = b[:, 96:108].int()
    scale = ((sc[:, k % 8] >> (4 * (k // 8))) & 0x0F) | (((sc[:, 8 + k % 4] >> (2 * (k // 4))) & 3) << 4)
    dl = _half(b, 108) * (scale - 32).float()  # [n, 16]
    i = torch.arange(256, device=b.device)
    high = (b[:, :32].int()[:, lane] >> (i // 32)) & 1
    q = ((b[:, 32:96].int()[:, 32 * c + lane] >> (2 * s)) & 3) - torch.where(high != 0, 0, 4)
    return dl[:, i // 16] * q.float()


def _k_scales(b) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 sub-block scales and mins of Q4_K / Q5_K blocks, 6 bits each: int32 [n, 8] twice."""
    s = b[:, 4:16].int()
    j = torch.arange(4, device=b.device)
    sc = torch.cat([s[:, j] & 63, (s[:, j + 8] & 0x0F) | ((s[:, j] >> 6) << 4)], 1)
    m = torch.cat([s[:, j + 4] & 63, (s[:, j + 8] >> 4) | ((s[:, j + 4] >> 6) << 4)], 1)
    return sc, m


def _q4_k(b):
    n = b.shape[0]
    sc, m = _k_scales(b)
    d = _half(b, 0) * sc.float()  # [n, 8]
    mins = _half(b, 2) * m.float()
    lo, hi = _nibbles(b[:, 16:144].reshape(n, 4, 32))
    q = torch.stack([lo, hi], 2).reshape(n, 8, 32)  # sub-block 2p: low nibbles of pair p; 2p + 1: high
    return (d[:, :, None] * q.float() - mins[:, :, None]).reshape(n, 256)


def _q5_k(b):
    n = b.shape[0]
    sc, m = _k_scales(b)
    d = _half(b, 0) * sc.float()
    mins = _half(b, 2) * m.float()
    lo, hi = _nibbles(b[:, 48:176].reshape(n, 4, 32))
    q = torch.stack([lo, hi], 2).reshape(n, 8, 32)
    qh = b[:, 16:48].int()  # bit j of qh[l]: the fifth bit of sub-block j's value l
    fifth = (qh[:, None, :] >> torch.arange(8, device=b.device)[None, :, None]) & 1
    return (d[:, :, None] * (q | (fifth << 4)).float() - mins[:, :, None]).reshape(n, 256)


def _q6_k(b):
    n = b.shape[0]
    ql = b[:, :128].int().reshape(n, 2, 64)
    qh = b[:, 128:192].int().reshape(n, 2, 32)
    dl = _half(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    a, c = ql[:, :, :32], ql[:, :, 32:]
    q = (
        torch.stack(
            [
                (a & 0x0F) | ((qh & 3) << 4),
                (c & 0x0F) | (((qh >> 2) & 3) << 4),
                (a >> 4) | (((qh >> 4) & 3) << 4),
                (c >> 4) | (((qh >> 6) & 3) << 4),
            ],
            2,
        )
        - 32
    )  # [n, half, quarter, 32]: value 128 h + 32 quarter + l
    lane = torch.arange(32, device=b.device)
    scale = dl.reshape(n, 2, 8)[:, :, (torch.arange(4, device=b.device)[:, None] * 2 + lane // 16)]
    return (scale * q.float()).reshape(n, 256)


_BLOCKS = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


def dequantize_torch(qweight: torch.Tensor, qtype: QuantType, k: int) -> torch.Tensor:
    """uint8 [N, row_bytes] on any device -> fp32 [N, K] on that device, gguf.quants' values bit for bit."""
    check_shape(qweight, qtype, k)
    n = qweight.shape[0]
    if qtype.name == "F32":
        return qweight.contiguous().view(torch.float32).reshape(n, k).clone()
    if qtype.name == "F16":
        return qweight.contiguous().view(torch.float16).reshape(n, k).float()
    if qtype.name == "BF16":
        return qweight.contiguous().view(torch.bfloat16).reshape(n, k).float()
    fn = _BLOCKS[qtype.name]
    out = torch.empty(n, k, dtype=torch.float32, device=qweight.device)
    rows = max(1, CHUNK_BYTES // max(1, qweight.shape[1]))
    for r in range(0, n, rows):
        part = qweight[r : r + rows].reshape(-1, qtype.block_bytes)
        out[r : r + rows] = fn(part).reshape(-1, k)
    return out

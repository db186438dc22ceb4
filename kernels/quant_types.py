"""GGUF's block-quantized weight types the kernels run natively: each type's GGML number and block shape, the
one table the CPU kernels (cpu/quant.py), the device dequantiser (gguf_dequant.py) and the loaders read."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class QuantType:
    name: str
    ggml_id: int  # GGML's number for the type, as GGUF files store it
    block_elems: int
    block_bytes: int

    def row_bytes(self, k: int) -> int:
        return k // self.block_elems * self.block_bytes


# The weight types the CPU kernels run natively.
QUANT_TYPES = {
    t.name: t
    for t in (
        QuantType("F32", 0, 1, 4),
        QuantType("F16", 1, 1, 2),
        QuantType("BF16", 30, 1, 2),
        QuantType("Q4_0", 2, 32, 18),
        QuantType("Q4_1", 3, 32, 20),
        QuantType("Q5_0", 6, 32, 22),
        QuantType("Q5_1", 7, 32, 24),
        QuantType("Q8_0", 8, 32, 34),
        QuantType("IQ4_NL", 20, 32, 18),
        QuantType("Q2_K", 10, 256, 84),
        QuantType("Q3_K", 11, 256, 110),
        QuantType("IQ4_XS", 23, 256, 136),
        QuantType("Q4_K", 12, 256, 144),
        QuantType("Q5_K", 13, 256, 176),
        QuantType("Q6_K", 14, 256, 210),
    )
}
QUANT_BY_ID = {t.ggml_id: t for t in QUANT_TYPES.values()}
# The block types the integer path multiplies (the float types always run with fp32 activations).
INT_DOT_TYPES = frozenset(n for n, t in QUANT_TYPES.items() if t.block_elems > 1)


def check_shape(qweight: torch.Tensor, qtype: QuantType, k: int) -> None:
    """Raise ValueError unless `qweight` is [N, row_bytes] uint8 for K = `k` values per row."""
    if k % qtype.block_elems:
        raise ValueError(f"{k} values per row is not a multiple of {qtype.name}'s block of {qtype.block_elems}")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] != qtype.row_bytes(k):
        raise ValueError(
            f"a {qtype.name} weight with {k} values per row needs uint8 [N, {qtype.row_bytes(k)}], "
            f"got {qweight.dtype} {tuple(qweight.shape)}"
        )

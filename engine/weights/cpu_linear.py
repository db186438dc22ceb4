"""Faster fp32 linear layers on x86 CPUs: weights pre-packed once for oneDNN.

A plain `F.linear` with a few rows re-packs the whole weight matrix on every
call, which costs 2-3x the time of reading it; the decode steps of a batching
engine are exactly such calls. oneDNN's packed layout is made once at load.

oneDNN multiplies a single row by a kernel of its own (a matrix-vector product
that sums in another order) and two or more by its GEMM, whose blocking does not
depend on the row count: a lone row goes in twice, so a row's result is the same
bits whatever else is in the call (tests/engine/test_cpu_linear.py).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

# Typical rows per call in decode-heavy batches; the packed layout is chosen for it.
_ROWS_HINT = 64


def packed_linear_available() -> bool:
    if os.environ.get("MINIBATCH_PACKED_LINEAR", "1") == "0":
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.randn(8, 4)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 2)
        out = torch.ops.mkldnn._linear_pointwise(torch.randn(2, 4), packed, None, "none", [], "")
        return out.shape == (2, 8)
    except (RuntimeError, AttributeError):
        return False


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's packed layout (fp32, CPU)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _ROWS_HINT)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        if x.shape[0] == 1:  # the GEMM's bits, not the matrix-vector kernel's: one row answers as in a batch
            return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1), self.packed, self.bias, "none", [], "")[:1]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Replace every fp32 nn.Linear under `model` by a PackedLinear; return how many."""
    count = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear) and child.weight.dtype == torch.float32:
            setattr(model, name, PackedLinear(child.weight, child.bias))
            count += 1
        else:
            count += pack_linears(child)
    return count


def linear(x: torch.Tensor, weight: torch.Tensor | PackedLinear) -> torch.Tensor:
    return weight(x) if isinstance(weight, PackedLinear) else F.linear(x, weight)

"""Linear and embedding layers that keep their weights GGUF block-quantized (CPU)."""

from __future__ import annotations

import torch
from torch import nn

from minibatch.kernels.cpu.quant import (
    dequantize,
    embedding,
    pack_rows8,
    quant_linear,
    quant_linear_q8,
    quantize_activations,
    unpack_rows8,
)
from minibatch.kernels.quant_types import INT_DOT_TYPES, QuantType


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W as GGUF blocks.

    `int8`: the activations are quantized to 8 bits per weight block (32 values, 256 for the K-quants)
    and multiplied in integers (the fast path); otherwise they stay fp32 and every block is dequantised
    exactly (the exact path). Float types (F16, BF16) always take the exact path. On the integer path the
    blocks are kept as the kernel streams them where it packs the type (`packed`: each eight rows' blocks
    interleaved, `pack_rows8`), in place of the file's order: no second copy."""

    def __init__(
        self,
        blocks: torch.Tensor,
        qtype: QuantType,
        in_features: int,
        bias: torch.Tensor | None = None,
        int8: bool = False,
    ) -> None:
        super().__init__()
        self.qtype, self.in_features, self.out_features = qtype, in_features, blocks.shape[0]
        self.int8 = int8 and qtype.name in INT_DOT_TYPES
        packed = pack_rows8(blocks, qtype) if self.int8 and blocks.device.type == "cpu" else None
        self.packed = packed is not None
        self.register_buffer("blocks", blocks if packed is None else packed)  # [out_features, row_bytes] uint8
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor, acts: dict | None = None) -> torch.Tensor:  # [rows, in] -> [rows, out]
        """`acts`: the input's quantized forms by block size, shared by several matrices of one input."""
        if self.int8:
            block = self.qtype.block_elems
            q = acts.get(block) if acts is not None else None
            if q is None:
                q = quantize_activations(x, block)
                if acts is not None:
                    acts[block] = q
            y = quant_linear_q8(q, self.blocks, self.qtype, self.packed)
        else:
            y = quant_linear(x, self.blocks, self.qtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        path = (", int8 activations" if self.int8 else "") + (", packed by eights" if self.packed else "")
        return f"{self.in_features} -> {self.out_features}, {self.qtype.name}{path}"


class StackedLinear(nn.Module):
    """Several projections of one input whose outputs are concatenated (q/k/v or gate/up kept apart
    because their weight types differ, as in the mixed-type files Q4_K_M and friends)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acts: dict = {}  # the input quantized once per block size, for every part on the integer path
        return torch.cat([p(x, acts) if isinstance(p, QuantLinear) and p.int8 else p(x) for p in self.parts], dim=-1)


class QuantEmbedding(nn.Module):
    """Token embeddings as GGUF blocks: a lookup dequantises only the rows it reads."""

    def __init__(self, blocks: torch.Tensor, qtype: QuantType, dim: int) -> None:
        super().__init__()
        self.qtype, self.dim = qtype, dim
        self.register_buffer("blocks", blocks)  # [vocab, row_bytes] uint8
        self.packed = False  # the blocks are a tied output projection's, packed by eights (QuantLinear)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [tokens] -> [tokens, dim]
        if self.packed:
            return dequantize(unpack_rows8(self.blocks, self.qtype, ids), self.qtype, self.dim)
        return embedding(self.blocks, self.qtype, self.dim, ids)

    def as_linear(self, int8: bool = False) -> QuantLinear:
        """The tied output projection, sharing these blocks: kept once, in its order where it packs them."""
        head = QuantLinear(self.blocks, self.qtype, self.dim, int8=int8)
        self.blocks, self.packed = head.blocks, head.packed
        return head

"""Linear and embedding layers that keep their weights GGUF block-quantized (CPU)."""

from __future__ import annotations

import torch
from torch import nn

from minibatch.kernels.quant import QuantType, embedding, quant_linear


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W as GGUF blocks; activations and accumulation fp32."""

    def __init__(self, blocks: torch.Tensor, qtype: QuantType, in_features: int, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.qtype, self.in_features, self.out_features = qtype, in_features, blocks.shape[0]
        self.register_buffer("blocks", blocks)  # [out_features, row_bytes] uint8
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out]
        y = quant_linear(x, self.blocks, self.qtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.qtype.name}"


class StackedLinear(nn.Module):
    """Several projections of one input whose outputs are concatenated (q/k/v or gate/up kept apart
    because their weight types differ, as in the mixed-type files Q4_K_M and friends)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


class QuantEmbedding(nn.Module):
    """Token embeddings as GGUF blocks: a lookup dequantises only the rows it reads."""

    def __init__(self, blocks: torch.Tensor, qtype: QuantType, dim: int) -> None:
        super().__init__()
        self.qtype, self.dim = qtype, dim
        self.register_buffer("blocks", blocks)  # [vocab, row_bytes] uint8

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [tokens] -> [tokens, dim]
        return embedding(self.blocks, self.qtype, self.dim, ids)

    def as_linear(self) -> QuantLinear:
        """The tied output projection, sharing these blocks."""
        return QuantLinear(self.blocks, self.qtype, self.dim)

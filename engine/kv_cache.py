"""The paged KV cache tensors: one [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer."""

from __future__ import annotations

import torch

from .models.config import ModelConfig


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Memory one block takes across all layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def num_blocks_for_budget(cfg: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    return max(0, budget_bytes // bytes_per_block(cfg, block_size, dtype))


def allocate_kv_cache(
    cfg: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]

"""The paged KV cache tensors: one [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer."""

from __future__ import annotations

import math

import torch

from minibatch.engine.models.config import ModelConfig


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
    if torch.device(device).type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
    # On the CPU the pool comes from calloc (through numpy), which maps fresh zero pages for an allocation this
    # size instead of writing zeros: the pool is ready at once and costs memory as blocks are first written,
    # where torch.zeros would spend ~0.4 s a GiB touching every page at start.
    import numpy as np

    per_layer = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    total = cfg.num_layers * per_layer
    raw = np.zeros(total + 64, dtype=np.uint8)
    start = -raw.ctypes.data % 64  # cache-line aligned, as torch's allocator would give
    pool = torch.from_numpy(raw[start : start + total])
    return [pool[i * per_layer : (i + 1) * per_layer].view(dtype).view(shape) for i in range(cfg.num_layers)]

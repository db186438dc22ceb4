"""The paged KV cache tensors: one [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer."""

from __future__ import annotations

import contextlib
import math
import mmap

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
    # On the CPU the pool is an anonymous mapping: the kernel maps zero pages as blocks are first written, so the
    # pool is ready at once and costs memory as it is used, where torch.zeros would spend ~0.4 s a GiB touching
    # every page at start. It asks for transparent huge pages: a first write of a token's KV (46 KB on the
    # built-in model) cost ~107 us of page faults in 4 KB pages on the machine of BENCHMARKS.md, ~44 us in 2 MB
    # ones, about a tenth of a prefill on a pool not yet written; memory then grows by 2 MB a layer's K or V at a
    # time. Where the kernel has no huge pages (or no madvise), 4 KB pages.
    per_layer = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    total = cfg.num_layers * per_layer
    raw = mmap.mmap(-1, max(total, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):
        raw.madvise(mmap.MADV_HUGEPAGE)
    pool = torch.frombuffer(raw, dtype=torch.uint8, count=total)  # page-aligned; keeps the mapping alive
    return [pool[i * per_layer : (i + 1) * per_layer].view(dtype).view(shape) for i in range(cfg.num_layers)]

"""The paged KV cache tensors: one [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer."""

from __future__ import annotations

import contextlib
import math
import mmap

import torch

from minibatch.engine.models.config import ModelConfig

# 4 KB pages for the pool, also where the kernel would give huge ones: a first write into a 2 MB page zeroes all
# of it, and a fresh pool's first prefill writes into one per layer's K and V (12 copy-heavy prompts prefilled
# by a fresh process each, alternating: 705, 633, 543, 685 tok/s with 4 KB pages, 551, 529, 514, 551 with 2 MB)
PAGE_ADVICE = getattr(mmap, "MADV_NOHUGEPAGE", None)


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
    # On the CPU the pool is an anonymous mapping of its own: the kernel maps zero pages as blocks are first
    # written, so the pool is ready at once and costs memory as it is used (torch.zeros would spend ~0.4 s a
    # GiB touching every page at start), and it is unmapped when its last tensor goes. calloc (numpy's zeros,
    # before) gave the same only when its memory came fresh from the kernel: a request this size is served from
    # a free chunk of the heap when one is large enough (after a model load's temporaries, say), and calloc then
    # writes zeros over all of it, so the whole pool was resident from the start.
    per_layer = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    total = cfg.num_layers * per_layer
    raw = mmap.mmap(-1, max(total, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if PAGE_ADVICE is not None:
        with contextlib.suppress(OSError):
            raw.madvise(PAGE_ADVICE)
    pool = torch.frombuffer(raw, dtype=torch.uint8, count=total)  # page-aligned; holds the mapping
    return [pool[i * per_layer : (i + 1) * per_layer].view(dtype).view(shape) for i in range(cfg.num_layers)]

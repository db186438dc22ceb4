"""The CPU KV pool: zeros, one tensor per layer over one mapping, memory taken only as blocks are written."""

from __future__ import annotations

from types import SimpleNamespace

import psutil
import torch

from minibatch.engine.runner.kv_cache import allocate_kv_cache, bytes_per_block


def test_the_pool_is_zero_its_layers_apart_and_costs_memory_only_as_written():
    cfg = SimpleNamespace(num_layers=4, num_kv_heads=2, head_dim=64)
    blocks, block_size = 4096, 16  # 4096 blocks x 16 KB = 256 MB reserved
    proc = psutil.Process()
    before = proc.memory_info().rss
    caches = allocate_kv_cache(cfg, blocks, block_size)
    reserved = bytes_per_block(cfg, block_size, torch.float32) * blocks
    assert proc.memory_info().rss - before < reserved // 4  # mapped, not yet committed
    assert [c.shape for c in caches] == [(2, blocks, block_size, 2, 64)] * 4
    assert all(c.is_contiguous() and not c.any() for c in caches)
    caches[1][0, 7] = 1.0  # one block's K in one layer: no other layer, block or half sees it
    assert caches[1][0, 7].all() and int(caches[1].count_nonzero()) == block_size * 2 * 64
    assert not any(c.any() for i, c in enumerate(caches) if i != 1)

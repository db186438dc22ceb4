"""The paged KV cache: per layer a PagedKV of K and V, each [num_blocks, block_size, num_kv_heads, row] in its
cache type (kernels/kv_types.py: f32, f16, bf16 or q8_0), and the types' choice and byte counts."""

from __future__ import annotations

import contextlib
import math
import mmap

import torch

from minibatch.engine.models.config import ModelConfig
from minibatch.kernels.kv_types import (
    KVCacheTypes,
    PagedKV,
    row_bytes,
    row_width,
    storage_dtype,
    type_problem,
)

# 4 KB pages for the pool, also where the kernel would give huge ones: a first write into a 2 MB page zeroes all
# of it, and a fresh pool's first prefill writes into one per layer's K and V (12 copy-heavy prompts prefilled
# by a fresh process each, alternating: 705, 633, 543, 685 tok/s with 4 KB pages, 551, 529, 514, 551 with 2 MB)
PAGE_ADVICE = getattr(mmap, "MADV_NOHUGEPAGE", None)


def bytes_per_token(cfg: ModelConfig, types: KVCacheTypes) -> int:
    """Memory one token's K and V take across all layers."""
    per_head = row_bytes(types.k, cfg.head_dim) + row_bytes(types.v, cfg.head_dim)
    return cfg.num_layers * cfg.num_kv_heads * per_head


def bytes_per_block(cfg: ModelConfig, block_size: int, types: KVCacheTypes) -> int:
    """Memory one block takes across all layers (K and V)."""
    return block_size * bytes_per_token(cfg, types)


def num_blocks_for_budget(cfg: ModelConfig, block_size: int, types: KVCacheTypes, budget_bytes: int) -> int:
    return max(0, budget_bytes // bytes_per_block(cfg, block_size, types))


def types_problem(cfg: ModelConfig, types: KVCacheTypes) -> str | None:
    """Why this model's cache cannot be kept in these types, or None."""
    for kv_type in dict.fromkeys((types.k, types.v)):
        problem = type_problem(kv_type, cfg.head_dim)
        if problem:
            return problem
    return None


def allocate_kv_cache(
    cfg: ModelConfig,
    num_blocks: int,
    block_size: int,
    types: KVCacheTypes | None = None,  # None: f32
    device: torch.device | str = "cpu",
) -> list[PagedKV]:
    types = types or KVCacheTypes("f32", "f32")
    shapes = [(num_blocks, block_size, cfg.num_kv_heads, row_width(t, cfg.head_dim)) for t in (types.k, types.v)]
    dtypes = [storage_dtype(t) for t in (types.k, types.v)]
    if torch.device(device).type != "cpu":
        return [
            PagedKV(*(torch.zeros(shape, dtype=dt, device=device) for shape, dt in zip(shapes, dtypes)))
            for _ in range(cfg.num_layers)
        ]
    # On the CPU the pool is an anonymous mapping of its own: the kernel maps zero pages as blocks are first
    # written, so the pool is ready at once and costs memory as it is used (torch.zeros would spend ~0.4 s a
    # GiB touching every page at start), and it is unmapped when its last tensor goes. calloc (numpy's zeros,
    # before) gave the same only when its memory came fresh from the kernel: a request this size is served from
    # a free chunk of the heap when one is large enough (after a model load's temporaries, say), and calloc then
    # writes zeros over all of it, so the whole pool was resident from the start.
    sizes = [math.prod(shape) * torch.empty((), dtype=dt).element_size() for shape, dt in zip(shapes, dtypes)]
    sizes = [-(-n // 64) * 64 for n in sizes]  # each tensor on a cache line of its own
    per_layer = sum(sizes)
    total = cfg.num_layers * per_layer
    raw = mmap.mmap(-1, max(total, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if PAGE_ADVICE is not None:
        with contextlib.suppress(OSError):
            raw.madvise(PAGE_ADVICE)
    pool = torch.frombuffer(raw, dtype=torch.uint8, count=total)  # page-aligned; holds the mapping
    layers = []
    for i in range(cfg.num_layers):
        at = i * per_layer
        k = pool[at : at + math.prod(shapes[0]) * dtypes[0].itemsize].view(dtypes[0]).view(shapes[0])
        at += sizes[0]
        v = pool[at : at + math.prod(shapes[1]) * dtypes[1].itemsize].view(dtypes[1]).view(shapes[1])
        layers.append(PagedKV(k, v))
    return layers


class KVBlockIO:
    """One pool block's contents as bytes, every layer's K then V (what the disk tier files): copied out of the
    pool for a batch of blocks at once, put back one block at a time. On the CPU through NumPy views of the pool:
    where every layer's K (and V) lies at one distance from the next, as allocate_kv_cache lays them out, a block
    is two strided views, so a block goes in or out in two copies (which leave the interpreter free); elsewhere
    through the device."""

    def __init__(self, caches: list[PagedKV], numpy_views: bool | None = None) -> None:
        self.tensors = [t for kv in caches for t in (kv.k, kv.v)]
        self.widths = [t[0].numel() * t.element_size() for t in self.tensors]
        self.block_bytes = sum(self.widths)
        on_cpu = self.tensors[0].device.type == "cpu"
        self.views = self.strided = None
        if on_cpu if numpy_views is None else numpy_views:
            self.views = [t.view(torch.uint8).view(t.shape[0], -1).numpy() for t in self.tensors]
            self.strided = _strided(caches, self.views)

    def read(self, block_ids) -> list[memoryview]:
        """Copies of the blocks' contents, now (each a buffer of its own)."""
        import numpy as np

        if not block_ids:
            return []
        if self.strided is not None:  # one copy a block, into an array of its own the writer keeps
            k, v = self.strided
            rows = np.empty((len(block_ids), k.shape[1], k.shape[2] + v.shape[2]), dtype=np.uint8)
            for row, b in zip(rows, block_ids):
                row[:, : k.shape[2]] = k[b]
                row[:, k.shape[2] :] = v[b]
            return [memoryview(row.reshape(-1)) for row in rows]
        if self.views is not None:
            ids = np.asarray(block_ids, dtype=np.int64)
            rows = np.concatenate([v[ids] for v in self.views], axis=1)
        else:
            ids = torch.as_tensor(block_ids, device=self.tensors[0].device)
            parts = [t.index_select(0, ids).view(torch.uint8).reshape(len(block_ids), -1) for t in self.tensors]
            rows = torch.cat(parts, dim=1).cpu().numpy()
        return [memoryview(row) for row in np.ascontiguousarray(rows)]

    def write(self, block_id: int, payload) -> None:
        import numpy as np

        data = np.frombuffer(payload, dtype=np.uint8)
        if data.size != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes, got {data.size}")
        if self.strided is not None:
            k, v = self.strided
            layers = data.reshape(k.shape[1], -1)
            k[block_id] = layers[:, : k.shape[2]]
            v[block_id] = layers[:, k.shape[2] :]
            return
        at = 0
        if self.views is not None:
            for view, width in zip(self.views, self.widths):
                view[block_id] = data[at : at + width]
                at += width
            return
        src = torch.from_numpy(data.copy())
        for t, width in zip(self.tensors, self.widths):
            t[block_id].view(torch.uint8).view(-1).copy_(src[at : at + width].to(t.device))
            at += width


def _strided(caches: list[PagedKV], views):
    """Every layer's K as one [blocks, layers, width] view of the pool, and V's (None unless the layers lie
    at equal distances with equal shapes: then a block's rows across the layers are one strided slice)."""
    import numpy as np

    out = []
    for role in (0, 1):
        arrays = views[role::2]
        first = arrays[0]
        if any(a.shape != first.shape or not a.flags.c_contiguous for a in arrays):
            return None
        starts = [a.__array_interface__["data"][0] for a in arrays]
        step = starts[1] - starts[0] if len(starts) > 1 else first.nbytes
        if any(b - a != step for a, b in zip(starts, starts[1:])):
            return None
        blocks, width = first.shape
        out.append(np.lib.stride_tricks.as_strided(first, (blocks, len(arrays), width), (width, step, 1)))
    return tuple(out)

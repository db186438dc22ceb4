"""Attention through the Triton kernels: KV store by slot mapping, then paged attention over the mixed batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import AttentionMetadata


@dataclass(slots=True)
class _TritonPlan:
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with the null block
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    max_query_len: int


class TritonAttentionBackend:
    name = "triton"

    def prepare(self, meta: AttentionMetadata) -> None:
        device = meta.slot_mapping.device
        bs = meta.block_size
        rows = len(meta.seq_lens)
        width = max(-(-n // bs) for n in meta.seq_lens)
        # seq_lens | query starts | block tables, in one int32 host buffer uploaded once
        host = torch.zeros(2 * rows + 1 + rows * width, dtype=torch.int32)
        host[:rows] = torch.tensor(meta.seq_lens, dtype=torch.int32)
        host[rows + 1 : 2 * rows + 1] = torch.tensor(meta.query_lens, dtype=torch.int32).cumsum(0)
        tables = host[2 * rows + 1 :].view(rows, width)
        for i, (t, n) in enumerate(zip(meta.block_tables, meta.seq_lens)):
            k = -(-n // bs)
            tables[i, :k] = torch.tensor(t[:k], dtype=torch.int32)
        if device.type == "cuda":
            host = host.pin_memory().to(device, non_blocking=True)
        meta.plan = _TritonPlan(
            host[2 * rows + 1 :].view(rows, width), host[rows : 2 * rows + 1], host[:rows], max(meta.query_lens)
        )

    def forward(self, q, k, v, kv_cache, meta, scale):
        from minibatch.kernels.kv_store import store_kv
        from minibatch.kernels.paged_attention import paged_attention

        store_kv(k.contiguous(), v.contiguous(), kv_cache, meta.slot_mapping)
        plan: _TritonPlan = meta.plan
        return paged_attention(
            q.contiguous(),
            kv_cache,
            plan.block_tables,
            plan.query_start_loc,
            plan.seq_lens,
            scale,
            plan.max_query_len,
            meta.window,
            meta.softcap,
        )


# What the Triton kernels support, checked when the engine is built (never a failure mid-serving).
GPU_BLOCK_SIZES = (
    8,
    16,
    32,
    64,
    128,
)  # powers of two; past 128 a key tile no longer fits shared memory at head_dim 256
GPU_HEAD_DIMS = (16, 32, 64, 128, 256)  # tl.dot needs >= 16 and a power of two; 256 is the largest tile we size for


def gpu_shape_problems(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> list[str]:
    """Why the Triton path cannot run this model and block size (empty when it can)."""
    problems = []
    if block_size not in GPU_BLOCK_SIZES:
        problems.append(f"block_size {block_size} (the GPU kernels take {', '.join(map(str, GPU_BLOCK_SIZES))})")
    if head_dim not in GPU_HEAD_DIMS:
        problems.append(f"head_dim {head_dim} (the GPU kernels take {', '.join(map(str, GPU_HEAD_DIMS))})")
    if num_heads % num_kv_heads:
        problems.append(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    return problems


def select_backend(device: str, dtype: torch.dtype):
    """(attention backend, model ops): Triton on CUDA; on CPU, PyTorch (+ the C++ decode kernel for fp32)."""
    from .attention import TorchAttentionBackend
    from .models.ops import CpuOps, TorchOps, TritonOps

    if device == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return TorchAttentionBackend(), TorchOps()
        return TritonAttentionBackend(), TritonOps()
    if dtype == torch.float32:
        from minibatch.kernels.cpu_paged_attention import (
            load_extension,
            paged_decode_attention,
            store_and_decode_attention,
        )

        ext = load_extension()  # compiled on first use, then cached
        if ext is not None:
            return TorchAttentionBackend(paged_decode_attention, store_and_decode_attention), CpuOps(ext)
    return TorchAttentionBackend(), TorchOps()

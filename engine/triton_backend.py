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
        width = max(-(-n // bs) for n in meta.seq_lens)
        tables = [t[: -(-n // bs)] + [0] * (width - -(-n // bs)) for t, n in zip(meta.block_tables, meta.seq_lens)]
        starts = [0]
        for n in meta.query_lens:
            starts.append(starts[-1] + n)
        meta.plan = _TritonPlan(
            torch.tensor(tables, dtype=torch.int32, device=device),
            torch.tensor(starts, dtype=torch.int32, device=device),
            torch.tensor(meta.seq_lens, dtype=torch.int32, device=device),
            max(meta.query_lens),
        )

    def forward(self, q, k, v, kv_cache, meta, scale):
        from minibatch.kernels.kv_store import store_kv
        from minibatch.kernels.paged_attention import paged_attention

        store_kv(k.contiguous(), v.contiguous(), kv_cache, meta.slot_mapping)
        plan: _TritonPlan = meta.plan
        return paged_attention(q.contiguous(), kv_cache, plan.block_tables, plan.query_start_loc, plan.seq_lens, scale,
                               plan.max_query_len)


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
        from minibatch.kernels.cpu_paged_attention import load_extension, paged_decode_attention, store_and_decode_attention

        ext = load_extension()  # compiled on first use, then cached
        if ext is not None:
            return TorchAttentionBackend(paged_decode_attention, store_and_decode_attention), CpuOps(ext)
    return TorchAttentionBackend(), TorchOps()

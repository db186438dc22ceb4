"""Attention through the Triton kernels: KV store by slot mapping, then paged attention over the mixed batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minibatch.engine.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class TritonPlan:
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with the null block
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    max_query_len: int
    min_query_len: int  # 1: the batch has decode rows (kernels/gpu/paged_decode.py's)
    max_seq_len: int  # the longest context, which bounds the decode kernel's grid


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
        meta.plan = TritonPlan(
            host[2 * rows + 1 :].view(rows, width),
            host[rows : 2 * rows + 1],
            host[:rows],
            max(meta.query_lens),
            min(meta.query_lens),
            max(meta.seq_lens),
        )

    def forward(self, q, k, v, kv_cache, meta, scale):
        from minibatch.kernels.gpu.kv_store import store_kv
        from minibatch.kernels.gpu.paged_attention import paged_attention

        store_kv(k.contiguous(), v.contiguous(), kv_cache, meta.slot_mapping)
        plan: TritonPlan = meta.plan
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
            plan.max_seq_len,
            plan.min_query_len,
            meta.image_spans,
        )

"""CUDA graphs for decode steps: capture the forward once per batch size, then replay.

A decode step of n requests is padded up to the next captured size; padding
rows read the null block (block 0, never handed out), have a context of one
token and a negative slot, so the KV store skips them. Graphs are a GPU-only
path; the size and padding bookkeeping is plain and tested on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import AttentionMetadata, FlatBatch


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (as the batch grows, padding stays < 8 rows)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds n rows, or None (run eagerly)."""
    for s in sizes:
        if s >= n:
            return s
    return None


@dataclass(slots=True)
class DecodeInputs:
    """Static buffers a captured graph reads; each replay copies the step's rows in and pads the rest."""

    input_ids: torch.Tensor  # [size] int64
    positions: torch.Tensor  # [size] int64
    slot_mapping: torch.Tensor  # [size] int64, -1 for padding rows
    block_tables: torch.Tensor  # [size, max_blocks] int32, padding rows all null block
    seq_lens: torch.Tensor  # [size] int32, 1 for padding rows
    query_start_loc: torch.Tensor  # [size + 1] int32: 0, 1, 2, ...

    @classmethod
    def empty(cls, size: int, max_blocks: int, device) -> "DecodeInputs":
        return cls(
            torch.zeros(size, dtype=torch.long, device=device),
            torch.zeros(size, dtype=torch.long, device=device),
            torch.full((size,), -1, dtype=torch.long, device=device),
            torch.zeros(size, max_blocks, dtype=torch.int32, device=device),
            torch.ones(size, dtype=torch.int32, device=device),
            torch.arange(size + 1, dtype=torch.int32, device=device),
        )

    def fill(self, batch: FlatBatch) -> int:
        """Copy a pure-decode batch in; the rows past it become padding. Returns the real row count."""
        n = batch.input_ids.numel()
        meta = batch.attn
        self.input_ids[:n].copy_(batch.input_ids)
        self.input_ids[n:].zero_()
        self.positions[:n].copy_(batch.positions)
        self.positions[n:].zero_()
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:].fill_(-1)
        width = self.block_tables.shape[1]
        bs = meta.block_size
        rows = [t[: -(-ln // bs)] for t, ln in zip(meta.block_tables, meta.seq_lens)]
        tables = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
        self.block_tables.zero_()
        self.block_tables[:n].copy_(tables)
        self.seq_lens.fill_(1)
        self.seq_lens[:n].copy_(torch.tensor(meta.seq_lens, dtype=torch.int32))
        return n


class DecodeGraphs:
    """Captured decode forwards keyed by padded batch size (CUDA only)."""

    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int, max_model_len: int, max_num_seqs: int) -> None:
        from .triton_backend import _TritonPlan

        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks = -(-max_model_len // block_size)
        self.device = kv_caches[0].device
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, DecodeInputs, torch.Tensor]] = {}
        self._plan_cls = _TritonPlan

    def _meta(self, inp: DecodeInputs, size: int) -> AttentionMetadata:
        meta = AttentionMetadata([1] * size, [1] * size, self.block_size, inp.slot_mapping, [[0]] * size)
        meta.plan = self._plan_cls(inp.block_tables, inp.query_start_loc, inp.seq_lens, 1)
        return meta

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            inp = DecodeInputs.empty(size, self.max_blocks, self.device)
            meta = self._meta(inp, size)
            for _ in range(2):  # warm up: Triton compiles, allocator settles
                self.model.forward_planned(inp.input_ids, inp.positions, self.kv_caches, meta)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model.forward_planned(inp.input_ids, inp.positions, self.kv_caches, meta)
                logits = self.model.compute_logits(hidden)
            pool = graph.pool()
            self.graphs[size] = (graph, inp, logits)

    def run(self, batch: FlatBatch) -> torch.Tensor | None:
        """Logits for a pure-decode batch by replay, or None when no graph fits (run eagerly)."""
        n = batch.input_ids.numel()
        size = padded_size(n, self.sizes)
        if size is None or size not in self.graphs or max(batch.attn.query_lens) != 1:
            return None
        if max(batch.attn.seq_lens) > self.max_blocks * self.block_size:
            return None
        graph, inp, logits = self.graphs[size]
        inp.fill(batch)
        graph.replay()
        return logits[:n]

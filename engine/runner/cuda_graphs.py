"""CUDA graphs for decode steps: capture the forward once per batch size, then replay.

A decode step of n requests is padded up to the next captured size; padding
rows read the null block (block 0, never handed out), have a context of one
token and a negative slot, so the KV store skips them. Graphs are a GPU-only
path; the size and padding bookkeeping is plain and tested on CPU.
"""

from __future__ import annotations

import torch

from minibatch.engine.attention.metadata import AttentionMetadata, FlatBatch
from minibatch.engine.attention.triton_backend import TritonPlan
from minibatch.kernels.kv_types import PagedKV


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


class DecodeInputs:
    """Static buffers a captured graph reads; each replay copies the step's rows in and pads the rest.

    Per step the token ids, positions and slots come from the flat batch
    (already on the device: three device-to-device copies). The sequence
    lengths and block tables live in one int32 host buffer (pinned on a GPU)
    mirrored on the device: a row of the block table is rewritten only when
    its request's block list changed (the block manager hands out a new list
    whenever it allocates, so an unchanged list object means unchanged
    contents), and the lengths plus the changed rows go up in at most two
    non-blocking copies. Padding rows have length 1, slot -1 and read the
    null block.
    """

    def __init__(self, size: int, max_blocks: int, device) -> None:
        device = torch.device(device)
        self.size, self.max_blocks, self.device = size, max_blocks, device
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        # [seq_lens (size) | block tables (size x max_blocks)]
        host = torch.zeros(size + size * max_blocks, dtype=torch.int32)
        host[:size] = 1
        self._host = host.pin_memory() if device.type == "cuda" else host
        self._dev = self._host.to(device, copy=True)
        self.seq_lens = self._dev[:size]
        self.block_tables = self._dev[size:].view(size, max_blocks)
        self._host_tables = self._host[size:].view(size, max_blocks)
        self._rows: list[list[int] | None] = [None] * size  # the block list each row holds now
        self._lens = [0] * size
        self._n = 0
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self.rows_written = 0  # table rows rewritten so far (what the incremental fill saves is visible)

    def fill(self, batch: FlatBatch) -> int:
        """Copy a pure-decode batch in; the rows past it become padding. Returns the real row count."""
        n = batch.input_ids.numel()
        meta = batch.attn
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's upload has left the host buffer
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        if n < self._n:  # rows that were real last step become padding
            self.input_ids[n : self._n].zero_()
            self.positions[n : self._n].zero_()
            self.slot_mapping[n : self._n].fill_(-1)
        host, width = self._host, self.max_blocks
        host[:n] = torch.tensor(meta.seq_lens, dtype=torch.int32)
        host[n : max(n, self._n)] = 1
        first = last = -1
        for i, table in enumerate(meta.block_tables):
            k = min(len(table), width)
            prev, done = self._rows[i], self._lens[i]
            if table is prev and k == done:
                continue
            # the same request with a block more: its list starts with what the row holds (a C-speed compare)
            keep = done if prev is not None and 0 < done <= k and table[:done] == prev[:done] else 0
            self._host_tables[i, keep:k] = torch.tensor(table[keep:k], dtype=torch.int32)
            self._rows[i], self._lens[i] = table, k
            first = i if first < 0 else first
            last = i
        for i in range(n, self._n):  # new padding rows read the null block
            self._host_tables[i, 0] = 0
            self._rows[i], self._lens[i] = None, 0
            first = i if first < 0 else first
            last = i
        self.rows_written += 0 if first < 0 else last - first + 1
        self._n = n
        non_blocking = self.device.type == "cuda"
        size = self.size
        if first == 0:
            self._dev[: size + (last + 1) * width].copy_(host[: size + (last + 1) * width], non_blocking=non_blocking)
        else:
            self._dev[:size].copy_(host[:size], non_blocking=non_blocking)
            if first > 0:
                lo, hi = size + first * width, size + (last + 1) * width
                self._dev[lo:hi].copy_(host[lo:hi], non_blocking=non_blocking)
        if self._copied is not None:
            self._copied.record()
        return n


class DecodeGraphs:
    """Captured decode forwards keyed by padded batch size (CUDA only)."""

    def __init__(self, model, kv_caches: list[PagedKV], block_size: int, max_model_len: int, max_num_seqs: int) -> None:
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks = -(-max_model_len // block_size)
        self.device = kv_caches[0].k.device
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, DecodeInputs, torch.Tensor]] = {}
        self._plan_cls = TritonPlan

    def _meta(self, inp: DecodeInputs, size: int) -> AttentionMetadata:
        meta = AttentionMetadata([1] * size, [1] * size, self.block_size, inp.slot_mapping, [[0]] * size)
        # the decode kernel's grid covers the longest context a graph serves (programs past a row's exit)
        meta.plan = self._plan_cls(
            inp.block_tables, inp.query_start_loc, inp.seq_lens, 1, 1, self.max_blocks * self.block_size
        )
        cfg = self.model.config
        meta.window, meta.softcap = cfg.sliding_window or 0, cfg.attn_softcap
        if cfg.layer_windows:  # the Triton plan does not depend on the window: one for every layer
            meta.plans = dict.fromkeys(cfg.layer_windows, meta.plan)
        return meta

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            inp = DecodeInputs(size, self.max_blocks, self.device)
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

    @torch.inference_mode()  # the captured inputs are inference tensors, as capture() made them
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

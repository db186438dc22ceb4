"""Flat-batch attention metadata and the protocol every attention backend follows.

One forward runs a flat batch of tokens from many sequences (no padding). Each
sequence contributes `query_len` new tokens (a prefill chunk, or 1 when
decoding) on top of `seq_len - query_len` tokens already in the cache. The new
tokens' K/V are written into the cache through `slot_mapping`; attention then
reads each sequence's whole context back through its block table.

Cache layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 holds K, 1 holds V).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from minibatch.kernels.kv_types import PagedKV


@dataclass(slots=True)
class AttentionMetadata:
    """What the attention layers need to know about one flat batch."""

    query_lens: list[int]  # new tokens per sequence in this forward
    seq_lens: list[int]  # context per sequence after this forward (cached + new)
    block_size: int
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset of each new token
    block_tables: list[list[int]]  # block ids per sequence, in position order
    # Filled by the backend's prepare(), once per forward, shared by all layers.
    plan: object | None = field(default=None)
    plans: dict[int, object] | None = field(default=None)  # per sliding window, when the layers' windows differ
    window: int = 0  # sliding window: a query attends to the last `window` positions only (0: all)
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) before the softmax (Gemma 2)
    # Asked between layers: True when nobody wants this forward's result any more (every row's request was
    # aborted meanwhile): the forward stops there (StepAbandoned)
    abandon: Callable[[], bool] | None = None
    # [num_tokens, 2] int32: for a row of an image whose positions attend to each other (Gemma 3's), the
    # image's [first, stop) positions: it attends to the later ones too (a sliding window still starts where it
    # did); (0, 0) for the others. None: every row causal
    image_spans: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.numel())


@dataclass(slots=True)
class FlatBatch:
    """Model inputs for one forward: token ids, their positions and the attention metadata."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [num_seqs] int64: the last new token of each sequence


def build_flat_batch(
    token_chunks: list[list[int]],
    num_cached: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> FlatBatch:
    """Pack each sequence's new tokens into one flat batch.

    token_chunks[i] are the tokens sequence i computes now; they sit at
    positions num_cached[i] .. num_cached[i] + len - 1, and block_tables[i]
    must cover every position up to the end of the chunk.
    """
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    last: list[int] = []
    for chunk, start, table in zip(token_chunks, num_cached, block_tables, strict=True):
        end = start + len(chunk)
        if not chunk:
            raise ValueError("every sequence in a flat batch needs at least one new token")
        if len(table) * block_size < end:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {end} tokens")
        ids.extend(chunk)
        for pos in range(start, end):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        query_lens.append(len(chunk))
        seq_lens.append(end)
        last.append(len(ids) - 1)
    # One host tensor, one upload: on a GPU from pinned memory without waiting for it.
    n = len(ids)
    packed = torch.tensor(ids + positions + slots + last, dtype=torch.long)
    if torch.device(device).type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    attn = AttentionMetadata(
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_size=block_size,
        slot_mapping=packed[2 * n : 3 * n],
        block_tables=block_tables,
    )
    return FlatBatch(input_ids=packed[:n], positions=packed[n : 2 * n], attn=attn, logits_indices=packed[3 * n :])


class AttentionBackend(Protocol):
    """Writes the new K/V into the paged cache and attends over each sequence's context."""

    name: str

    def prepare(self, meta: AttentionMetadata) -> None:
        """Build per-forward state (gather indices, masks) once for all layers."""

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: PagedKV,  # K and V, each [num_blocks, block_size, num_kv_heads, row] in its cache type
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...

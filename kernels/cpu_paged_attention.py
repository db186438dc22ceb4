"""CPU paged decode attention as a small C++ extension, compiled on first use (then cached).

The PyTorch path gathers each sequence's context out of the paged cache into a
contiguous copy every layer, then attends over the copy: the context crosses
memory three times. This kernel reads K and V once, in place, through the block
table. `paged_decode_attention_ref` is its PyTorch twin and the test reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cpu_ext import load_cpu_extension


def load_extension():
    """The compiled CPU extension, or None (then the PyTorch twin runs)."""
    return load_cpu_extension()


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    window: int = 0,  # sliding window: attend to the last `window` positions only (0: all)
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap) (Gemma 2)
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    ext = load_extension()
    if ext is None:
        return paged_decode_attention_ref(q, kv_cache, block_tables, seq_lens, scale, window, softcap)
    return ext.paged_decode_attention(
        q.contiguous(), kv_cache[0], kv_cache[1], block_tables, seq_lens, scale, window, float(softcap or 0.0)
    )


def store_and_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim], one new token per sequence
    k: torch.Tensor,  # [num_seqs, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_seqs, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_seqs] int64
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    window: int = 0,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Write the new K/V into the cache, then attend: one kernel call per layer at decode."""
    ext = load_extension()
    if ext is None:
        return store_and_decode_attention_ref(
            q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, scale, window, softcap
        )
    return ext.store_and_decode_attention(
        q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, scale, window, float(softcap or 0.0)
    )


def store_and_decode_attention_ref(
    q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, scale, window=0, softcap=None
):
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
    return paged_decode_attention_ref(q, kv_cache, block_tables, seq_lens, scale, window, softcap)


def paged_decode_attention_ref(q, kv_cache, block_tables, seq_lens, scale, window=0, softcap=None):
    """The PyTorch twin: gather each context through its block table, then attend (to the last `window` only,
    scores soft-capped when `softcap` is set)."""
    num_seqs, _, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    max_len = int(seq_lens.max())
    pos = torch.arange(max_len, device=q.device)
    blocks = block_tables.long().gather(
        1, (pos // block_size).expand(num_seqs, -1).clamp(max=block_tables.shape[1] - 1)
    )
    slots = blocks * block_size + pos % block_size  # [num_seqs, max_len]
    k = kv_cache[0].reshape(-1, num_kv_heads, head_dim)[slots]  # [num_seqs, max_len, kv_heads, head_dim]
    v = kv_cache[1].reshape(-1, num_kv_heads, head_dim)[slots]
    lens = seq_lens[:, None].long()
    mask = pos[None, :] < lens
    if window:
        mask &= pos[None, :] >= lens - window
    mask = mask[:, None, None, :]
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [num_seqs, kv_heads, max_len, head_dim]
    if softcap:
        groups = q.shape[1] // num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.tanh(q.unsqueeze(2) @ k.transpose(-1, -2) * scale / softcap) * softcap
        return (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v).squeeze(2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(2)

"""CPU paged attention as part of the C++ extension (csrc/paged_attention.cpp): one kernel for every query.

The PyTorch path gathers each sequence's context out of the paged cache into a
contiguous copy every layer, then attends over the copy: the context crosses
memory three times. This kernel reads K and V once, in place, through the block
table, and computes a decode token, a prefill, a chunk of one and a verify row by
one rule, so a token's result does not depend on which of those it was in or on
what else was in the batch. K and V may each be kept in any of kernels/kv_types.py's
types: a new token's rows are converted once as they are stored, and read back one
block at a time. `paged_attention_ref` is its PyTorch twin and the test reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kv_types import from_cache_ref, hadamard_ref, rotation, store_ref, type_of
from .extension import load_cpu_extension


def load_extension():
    """The compiled CPU extension, or None (then the PyTorch twin runs)."""
    return load_cpu_extension()


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]: every sequence's new tokens, back to back
    kv_cache,  # PagedKV (K, V), or one [2, num_blocks, block_size, num_kv_heads, row] tensor of one type
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: context after this forward (cached + new)
    query_start: torch.Tensor,  # [num_seqs + 1] int32: sequence s's rows of q are query_start[s] .. [s + 1] - 1
    scale: float,
    window: int = 0,  # sliding window: attend to the last `window` positions only (0: all)
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap) (Gemma 2)
    image_spans: torch.Tensor | None = None,  # [num_tokens, 2] int32 (AttentionMetadata.image_spans)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each new token over its sequence's context up to its own position (and, for a row
    of a whole image, over all of the image's positions)."""
    ext = load_extension()
    if ext is None:
        return paged_attention_ref(
            q, kv_cache, block_tables, seq_lens, query_start, scale, window, softcap, image_spans
        )
    return ext.paged_attention(
        q.contiguous(),
        kv_cache[0],
        kv_cache[1],
        block_tables,
        seq_lens,
        query_start,
        scale,
        window,
        float(softcap or 0),
        _spans(image_spans),
    )


def _spans(image_spans: torch.Tensor | None) -> torch.Tensor | None:
    """What the kernel takes: the spans, contiguous int32 (None: every row causal)."""
    return None if image_spans is None else image_spans.to(torch.int32).contiguous()


def store_and_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache,  # PagedKV (K, V), each [num_blocks, block_size, num_kv_heads, row] in its type, contiguous
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    window: int = 0,
    softcap: float | None = None,
    image_spans: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Write the new K/V into the cache, then attend: one kernel call per layer."""
    ext = load_extension()
    if ext is None:
        return store_and_attention_ref(
            q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start, scale, window, softcap, image_spans
        )
    return ext.store_and_attention(
        q,
        k,
        v,
        kv_cache[0],
        kv_cache[1],
        slot_mapping,
        block_tables,
        seq_lens,
        query_start,
        scale,
        window,
        float(softcap or 0),
        _spans(image_spans),
    )


def decode_query_start(num_seqs: int, device=None) -> torch.Tensor:
    """query_start for one new token per sequence."""
    return torch.arange(num_seqs + 1, dtype=torch.int32, device=device)


def paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale, window=0, softcap=None) -> torch.Tensor:
    """paged_attention with one query per sequence (q: [num_seqs, num_heads, head_dim])."""
    query_start = decode_query_start(q.shape[0], q.device)
    return paged_attention(q, kv_cache, block_tables, seq_lens, query_start, scale, window, softcap)


def store_and_attention_ref(
    q,
    k,
    v,
    kv_cache,
    slot_mapping,
    block_tables,
    seq_lens,
    query_start,
    scale,
    window=0,
    softcap=None,
    image_spans=None,
):
    for cache, new, role in zip(kv_cache, (k, v), "kv"):
        rows = store_ref(new.float(), type_of(cache, new.shape[-1]), role)
        cache.view(-1, *rows.shape[1:]).index_copy_(0, slot_mapping, rows)
    return paged_attention_ref(q, kv_cache, block_tables, seq_lens, query_start, scale, window, softcap, image_spans)


def paged_attention_ref(
    q, kv_cache, block_tables, seq_lens, query_start, scale, window=0, softcap=None, image_spans=None
):
    """The PyTorch twin of this kernel and of the Triton one (kernels/gpu/paged_attention.py), in fp32: per sequence,
    gather its context through its block table (as fp32, whatever the cache's type), then attend with each
    query limited to the positions up to its own, a row of a whole image (`image_spans`' [first, stop) not
    empty) to its image's later positions too, and either to the last `window` positions up to its own (the
    later image positions stay), scores soft-capped when `softcap` is set. Where the types keep K or V turned
    (kv_types.rotation), the queries are turned as K is and the output turned back as V is."""
    block_size, num_kv_heads = kv_cache[0].shape[1:3]
    head_dim = q.shape[-1]
    k_rot, v_rot = (rotation(type_of(c, head_dim), head_dim, role) for c, role in zip(kv_cache[:2], "kv"))
    out = torch.empty_like(q)
    starts = query_start.tolist()
    for s, ctx in enumerate(seq_lens.tolist()):
        lo, hi = starts[s], starts[s + 1]
        pos = torch.arange(ctx, device=q.device)
        slots = block_tables[s].long()[pos // block_size] * block_size + pos % block_size
        k, v = (from_cache_ref(c.reshape(-1, *c.shape[2:])[slots], q.shape[-1]).transpose(0, 1) for c in kv_cache[:2])
        qs = hadamard_ref(q[lo:hi].float(), k_rot).transpose(0, 1)  # [heads, qlen, head_dim], turned as K is
        q_pos = torch.arange(ctx - (hi - lo), ctx, device=q.device)[:, None]
        mask = pos[None, :] <= q_pos
        if image_spans is not None:  # (the window below still applies, as Gemma 3's local layers have it)
            first, stop = image_spans[lo:hi, 0:1].long(), image_spans[lo:hi, 1:2].long()
            mask |= (pos[None, :] >= first) & (pos[None, :] < stop)
        if window:
            mask &= pos[None, :] > q_pos - window
        groups = qs.shape[0] // num_kv_heads
        if softcap:
            k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
            scores = torch.tanh(qs @ k.transpose(-1, -2) * scale / softcap) * softcap
            o = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        else:
            o = F.scaled_dot_product_attention(
                qs[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True
            )[0]
        out[lo:hi] = hadamard_ref(o.transpose(0, 1), v_rot).to(q.dtype)  # turned back where V is turned
    return out

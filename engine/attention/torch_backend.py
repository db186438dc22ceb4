"""Attention in PyTorch over the paged KV cache: the CPU path (with the C++ decode kernel when it is built)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minibatch.engine.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class _TorchPlan:
    # Sequences with one new token attend together: in the C++ kernel (through block tables,
    # no copy) when it is available, else in one padded SDPA call over gathered contexts.
    decode_tokens: torch.Tensor | None  # [num_decode] flat token index
    decode_slots: torch.Tensor | None  # [num_decode * max_ctx] cache slot per context position (0 = pad)
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_ctx] True where a real context position
    decode_ctx: int
    decode_tables: torch.Tensor | None  # [num_decode, max_blocks] int32, padded with the null block
    decode_lens: torch.Tensor | None  # [num_decode] int32
    # Longer chunks attend one sequence at a time: (token start, query len, slots, mask or None).
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]
    all_decode: bool = False  # every token is a decode: the kernel reads q and writes out whole


class TorchAttentionBackend:
    """Attention in PyTorch (scaled_dot_product_attention); the CPU path.

    With `decode_kernel` (the CPU paged decode kernel from minibatch.kernels),
    single-token queries read K/V in place through their block tables.
    """

    name = "torch"

    def __init__(self, decode_kernel=None, store_decode_kernel=None) -> None:
        self.decode_kernel = decode_kernel
        self.store_decode_kernel = store_decode_kernel  # KV store + decode attention in one call

    def prepare(self, meta: AttentionMetadata) -> None:
        device = meta.slot_mapping.device
        bs = meta.block_size
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills = []
        start = 0
        for qlen, ctx, table in zip(meta.query_lens, meta.seq_lens, meta.block_tables):
            if qlen == 1:
                decode_rows.append(start)
                decode_tables.append(table)
                decode_lens.append(ctx)
            else:
                slots = _context_slots(table, ctx, bs, device)
                mask = None
                window = meta.window if meta.window and ctx > meta.window else 0
                if ctx != qlen or window:  # a chunk after cached context (causal with an offset), or a window
                    q_pos = torch.arange(ctx - qlen, ctx, device=device)[:, None]
                    k_pos = torch.arange(ctx, device=device)[None, :]
                    mask = k_pos <= q_pos
                    if window:
                        mask &= k_pos > q_pos - window
                prefills.append((start, qlen, slots, mask))
            start += qlen
        plan = _TorchPlan(None, None, None, 0, None, None, prefills, all_decode=not prefills)
        if decode_rows:
            plan.decode_tokens = torch.tensor(decode_rows, dtype=torch.long, device=device)
            if self.decode_kernel is not None:
                width = max(-(-n // bs) for n in decode_lens)
                plan.decode_tables = torch.tensor(
                    [t[: -(-n // bs)] + [0] * (width - -(-n // bs)) for t, n in zip(decode_tables, decode_lens)],
                    dtype=torch.int32,
                    device=device,
                )
                plan.decode_lens = torch.tensor(decode_lens, dtype=torch.int32, device=device)
            else:
                max_ctx = max(decode_lens)
                lens = torch.tensor(decode_lens, device=device)
                slots = torch.stack(
                    [_context_slots(t, max_ctx, bs, device, valid=n) for t, n in zip(decode_tables, decode_lens)]
                )
                plan.decode_slots = slots.reshape(-1)
                pos = torch.arange(max_ctx, device=device)[None, :]
                keep = pos < lens[:, None]
                if meta.window:
                    keep &= pos >= lens[:, None] - meta.window
                plan.decode_mask = keep[:, None, None, :]
                plan.decode_ctx = max_ctx
        meta.plan = plan

    def forward(self, q, k, v, kv_cache, meta, scale):
        plan: _TorchPlan = meta.plan
        window = meta.window
        if plan.all_decode and plan.decode_tables is not None and self.store_decode_kernel is not None:
            return self.store_decode_kernel(
                q, k, v, kv_cache, meta.slot_mapping, plan.decode_tables, plan.decode_lens, scale, window, meta.softcap
            )
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_flat = kv_cache[0].view(-1, num_kv_heads, head_dim)  # [num_slots, kv_heads, head_dim]
        v_flat = kv_cache[1].view(-1, num_kv_heads, head_dim)
        k_flat.index_copy_(0, meta.slot_mapping, k)
        v_flat.index_copy_(0, meta.slot_mapping, v)
        if plan.all_decode and plan.decode_tables is not None:
            return self.decode_kernel(q, kv_cache, plan.decode_tables, plan.decode_lens, scale, window, meta.softcap)
        out = torch.empty_like(q)
        if plan.decode_tables is not None:
            qd = q.index_select(0, plan.decode_tokens)  # [n, heads, head_dim]
            out.index_copy_(
                0,
                plan.decode_tokens,
                self.decode_kernel(qd, kv_cache, plan.decode_tables, plan.decode_lens, scale, window, meta.softcap),
            )
        elif plan.decode_tokens is not None:
            n = plan.decode_tokens.numel()
            kd = k_flat.index_select(0, plan.decode_slots).view(n, plan.decode_ctx, num_kv_heads, head_dim)
            vd = v_flat.index_select(0, plan.decode_slots).view(n, plan.decode_ctx, num_kv_heads, head_dim)
            qd = q.index_select(0, plan.decode_tokens).unsqueeze(2)  # [n, heads, 1, head_dim]
            od = _attention(qd, kd.transpose(1, 2), vd.transpose(1, 2), plan.decode_mask, False, scale, meta.softcap)
            out.index_copy_(0, plan.decode_tokens, od.squeeze(2))
        for start, qlen, slots, mask in plan.prefills:
            qp = q[start : start + qlen].transpose(0, 1).unsqueeze(0)  # [1, heads, qlen, head_dim]
            kp = k_flat.index_select(0, slots).transpose(0, 1).unsqueeze(0)  # [1, kv_heads, ctx, head_dim]
            vp = v_flat.index_select(0, slots).transpose(0, 1).unsqueeze(0)
            op = _attention(qp, kp, vp, mask, mask is None, scale, meta.softcap)
            out[start : start + qlen] = op.squeeze(0).transpose(0, 1)
        return out


def _attention(q, k, v, mask, causal: bool, scale: float, softcap: float | None) -> torch.Tensor:
    """SDPA over [1 or n, heads, len, head_dim]; with `softcap`, written out (SDPA cannot cap the scores)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        qlen, klen = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(qlen, klen, dtype=torch.bool, device=q.device).tril(klen - qlen)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.float().softmax(dim=-1).to(q.dtype), v)


def _context_slots(table: list[int], length: int, block_size: int, device, valid: int | None = None) -> torch.Tensor:
    """Cache slot of every context position 0..length-1 (positions past `valid` map to slot 0)."""
    valid = length if valid is None else valid
    n_blocks = -(-valid // block_size)
    blocks = torch.tensor(table[:n_blocks], dtype=torch.long, device=device)
    slots = (blocks[:, None] * block_size + torch.arange(block_size, device=device)[None, :]).reshape(-1)[:valid]
    if length > valid:
        slots = torch.cat([slots, slots.new_zeros(length - valid)])
    return slots

"""Attention over the paged KV cache on the CPU: the C++ paged kernel when it is built, else PyTorch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minibatch.engine.attention.metadata import AttentionMetadata
from minibatch.kernels.kv_types import from_cache_ref, hadamard_ref, rotation, store_ref, type_of


@dataclass(slots=True)
class _KernelPlan:
    # Every token of the batch in one kernel call, through the block tables (no copy of the context).
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with the null block
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start: torch.Tensor  # [num_seqs + 1] int32


@dataclass(slots=True)
class _TorchPlan:
    # Sequences with one new token attend together in one padded SDPA call over gathered contexts.
    decode_tokens: torch.Tensor | None  # [num_decode] flat token index
    decode_slots: torch.Tensor | None  # [num_decode * max_ctx] cache slot per context position (0 = pad)
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_ctx] True where a real context position
    decode_ctx: int
    # Longer chunks attend one sequence at a time: (token start, query len, slots, mask or None).
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]


# The CPU kernel's entry point (kernels/cpu/paged_attention.py store_and_attention): the new K/V stored, then
# every query attended, by one rule whatever the query's kind (docs/internals.md).
StoreAndAttend = Callable[..., torch.Tensor]


class TorchAttentionBackend:
    """Attention on the CPU: the C++ paged kernel when it is built, else PyTorch (scaled_dot_product_attention).

    With `kernel` (kernels/cpu/paged_attention.py's store_and_attention) every query — decode, prefill, a
    chunk over cached blocks, a verify row — reads K/V in place through its block table and is computed by
    one rule, so its result does not depend on the batch. Without it, PyTorch's SDPA (whose blocking
    depends on the query count: not batch-invariant) serves as the fallback and the reference.
    """

    def __init__(self, kernel: StoreAndAttend | None = None) -> None:
        self.kernel = kernel
        self.name = "torch" if kernel is None else "cpu-paged"

    def prepare(self, meta: AttentionMetadata) -> None:
        if self.kernel is not None:
            meta.plan = self._kernel_plan(meta)
        else:
            meta.plan = self._torch_plan(meta)

    @staticmethod
    def _kernel_plan(meta: AttentionMetadata) -> _KernelPlan:
        device, bs = meta.slot_mapping.device, meta.block_size
        used = [-(-n // bs) for n in meta.seq_lens]
        width = max(used)
        tables = [t[:u] + [0] * (width - u) for t, u in zip(meta.block_tables, used)]
        starts = [0]
        for qlen in meta.query_lens:
            starts.append(starts[-1] + qlen)
        packed = torch.tensor([x for t in tables for x in t] + list(meta.seq_lens) + starts, dtype=torch.int32)
        packed = packed.to(device)
        n = len(tables)
        return _KernelPlan(
            block_tables=packed[: n * width].view(n, width),
            seq_lens=packed[n * width : n * width + n],
            query_start=packed[n * width + n :],
        )

    @staticmethod
    def _torch_plan(meta: AttentionMetadata) -> _TorchPlan:
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
                spans = meta.image_spans[start : start + qlen] if meta.image_spans is not None else None
                if ctx != qlen or window or spans is not None:  # after cached context, a window, an image
                    q_pos = torch.arange(ctx - qlen, ctx, device=device)[:, None]
                    k_pos = torch.arange(ctx, device=device)[None, :]
                    mask = k_pos <= q_pos
                    if spans is not None:  # a whole image's rows attend to its later positions too
                        mask |= (k_pos >= spans[:, 0:1].long()) & (k_pos < spans[:, 1:2].long())
                    if window:
                        mask &= k_pos > q_pos - window
                prefills.append((start, qlen, slots, mask))
            start += qlen
        plan = _TorchPlan(None, None, None, 0, prefills)
        if decode_rows:
            plan.decode_tokens = torch.tensor(decode_rows, dtype=torch.long, device=device)
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
        return plan

    def forward(self, q, k, v, kv_cache, meta, scale):
        plan = meta.plan
        if isinstance(plan, _KernelPlan):
            return self.kernel(
                q,
                k,
                v,
                kv_cache,
                meta.slot_mapping,
                plan.block_tables,
                plan.seq_lens,
                plan.query_start,
                scale,
                meta.window,
                meta.softcap,
                meta.image_spans,
            )
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_flat = kv_cache[0].view(-1, *kv_cache[0].shape[2:])  # [num_slots, kv_heads, row] in the cache's type
        v_flat = kv_cache[1].view(-1, *kv_cache[1].shape[2:])
        k_type, v_type = type_of(k_flat, head_dim), type_of(v_flat, head_dim)
        k_flat.index_copy_(0, meta.slot_mapping, store_ref(k, k_type, "k"))
        v_flat.index_copy_(0, meta.slot_mapping, store_ref(v, v_type, "v"))
        v_rot = rotation(v_type, head_dim, "v")  # turned K and V: q turned as K is, the output turned back
        q = hadamard_ref(q, rotation(k_type, head_dim, "k")).to(q.dtype)
        out = torch.empty_like(q)
        if plan.decode_tokens is not None:
            n = plan.decode_tokens.numel()
            shape = (n, plan.decode_ctx, num_kv_heads, head_dim)
            kd = from_cache_ref(k_flat.index_select(0, plan.decode_slots), head_dim).to(q.dtype).view(shape)
            vd = from_cache_ref(v_flat.index_select(0, plan.decode_slots), head_dim).to(q.dtype).view(shape)
            qd = q.index_select(0, plan.decode_tokens).unsqueeze(2)  # [n, heads, 1, head_dim]
            od = _attention(qd, kd.transpose(1, 2), vd.transpose(1, 2), plan.decode_mask, False, scale, meta.softcap)
            out.index_copy_(0, plan.decode_tokens, od.squeeze(2))
        for start, qlen, slots, mask in plan.prefills:
            qp = q[start : start + qlen].transpose(0, 1).unsqueeze(0)  # [1, heads, qlen, head_dim]
            kp = (
                from_cache_ref(k_flat.index_select(0, slots), head_dim).to(q.dtype).transpose(0, 1).unsqueeze(0)
            )  # [1, kvh, ctx, d]
            vp = from_cache_ref(v_flat.index_select(0, slots), head_dim).to(q.dtype).transpose(0, 1).unsqueeze(0)
            op = _attention(qp, kp, vp, mask, mask is None, scale, meta.softcap)
            out[start : start + qlen] = op.squeeze(0).transpose(0, 1)
        return hadamard_ref(out, v_rot).to(q.dtype) if v_rot else out


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

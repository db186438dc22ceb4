"""Logit bias, penalties and DRY applied to a batch's logits on the GPU, before sampling: engine.models.ops.
LogitEdits' entries, one launch per phase (TorchOps.edit_logits is the twin)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _edit_kernel(logits_ptr, stride_l, rows_ptr, tokens_ptr, values_ptr, start, n, SCALE: tl.constexpr,
                 CLAMP: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """One phase of LogitEdits: each entry's logit gets its value added (or, SCALE, a positive logit divided by
    it and a negative one multiplied); CLAMP keeps the result finite."""
    i = start + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < start + n
    row = tl.load(rows_ptr + i, mask=inside, other=0)
    token = tl.load(tokens_ptr + i, mask=inside, other=0)
    v = tl.load(values_ptr + i, mask=inside, other=1.0)
    at = logits_ptr + row * stride_l + token
    x = tl.load(at, mask=inside, other=0.0)
    if SCALE:
        y = tl.where(x > 0, x / v, x * v)
    else:
        y = x + v
    if CLAMP:
        y = tl.minimum(tl.maximum(y, -3.4028234663852886e38), 3.4028234663852886e38)
    tl.store(at, y, mask=inside)


def edit_logits(
    logits: torch.Tensor,  # fp32 [rows, vocab], changed in place
    rows: torch.Tensor,  # int64 [E] (host)
    tokens: torch.Tensor,  # int64 [E] (host)
    values: torch.Tensor,  # float32 [E] (host)
    phases: tuple[int, int, int, int],  # entries of bias, repetition, presence/frequency and DRY, in order
) -> None:
    """engine.models.ops.LogitEdits applied on the logits' device (TorchOps.edit_logits is the twin): the entries
    go up in two copies, then one launch per phase present, in order. The twin keeps the whole batch finite
    after the penalties; here each penalised entry is kept finite where it is changed (the others are the
    model's finite logits)."""
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError("the logits must be fp32 rows with contiguous columns")
    total = sum(phases)
    if not total:
        return
    index = torch.stack([rows[:total], tokens[:total]]).to(logits.device, torch.int64)
    vals = values[:total].to(logits.device, torch.float32)
    block = 256
    start = 0
    for phase, n in enumerate(phases):
        if n:
            _edit_kernel[(triton.cdiv(n, block),)](
                logits, logits.stride(0), index[0], index[1], vals, start, n,
                SCALE=phase == 1, CLAMP=phase > 0, BLOCK=block,
            )  # fmt: skip
        start += n

"""The model's elementwise pieces behind one small interface: PyTorch twins (CPU) or Triton kernels (GPU)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F


class LogitEdits(NamedTuple):
    """What bias and penalties change in a batch's logits before sampling, as entries (row, token, value) in
    four phases applied in this order, each token at most once per row in a phase: bias (added), repetition
    (a positive logit divided by the value, a negative one multiplied), presence and frequency (added: the
    amounts negated), DRY (added, negated). Host tensors; the ops move them."""

    rows: torch.Tensor  # int64 [E]
    tokens: torch.Tensor  # int64 [E]
    values: torch.Tensor  # float32 [E]
    phases: tuple[int, int, int, int]  # entries of each phase, in order


class TorchOps:
    """Plain PyTorch; the CPU path and the reference the Triton kernels are tested against."""

    name = "torch"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [tokens, hidden]
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    @classmethod
    def add_rms_norm(cls, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x)"""
        h = residual + x
        return cls.rms_norm(h, weight, eps), h

    @staticmethod
    def rotary(positions, q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [tokens, heads, head_dim]; k: [tokens, kv_heads, head_dim]; cos/sin: [max_position, head_dim // 2]
        c = cos[positions].unsqueeze(1)
        s = sin[positions].unsqueeze(1)
        out = []
        for x in (q, k):
            x1, x2 = x.chunk(2, dim=-1)
            cx, sx = c.to(x.dtype), s.to(x.dtype)
            out.append(torch.cat((x1 * cx - x2 * sx, x2 * cx + x1 * sx), dim=-1))
        return out[0], out[1]

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [tokens, 2 * n] -> [tokens, n]
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def lora_update(
        y: torch.Tensor,  # [n, out]: the base projection of x
        x: torch.Tensor,  # [n, in]
        a: torch.Tensor,  # [S, R, in] fp16: the served adapters' A, zeros past each one's rank
        bt: torch.Tensor,  # [S, R, out] fp16: their B^T
        ranks: torch.Tensor,  # int32 [S]: each one's rank here (0: it leaves this projection alone)
        slots: torch.Tensor,  # int32 [n, K]: each row's adapters (-1: none)
        scales: torch.Tensor,  # fp32 [n, K]
    ) -> torch.Tensor:
        """y plus each row's adapters' scale * x A^T B^T: per adapter over its rows, in float64 (so a row's
        update does not depend on the rows beside it in the matmul), summed and rounded once."""
        delta = torch.zeros(y.shape, dtype=torch.float64, device=y.device)
        for s in sorted(set(slots[slots >= 0].tolist())):
            if int(ranks[s]) == 0:
                continue
            scale = torch.where(slots == s, scales.double(), 0.0).sum(dim=1)  # [n]: 0 where it is not the row's
            rows = scale.nonzero().flatten()
            if len(rows) == 0:
                continue
            update = (x[rows].double() @ a[s].double().T) @ bt[s].double()
            delta = delta.index_add(0, rows, update * scale[rows, None])
        return y + delta.to(y.dtype)

    @staticmethod
    def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:  # GeGLU (Gemma): gelu(gate, tanh approx.) * up
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    @staticmethod
    def argmax_rows(x: torch.Tensor) -> torch.Tensor:  # [rows, vocab] -> int64 [rows]: the sampler's argmax
        """Each row's argmax, the first of ties (a NaN counts as the largest)."""
        return x.argmax(dim=-1)

    @staticmethod
    def edit_logits(logits: torch.Tensor, edits: LogitEdits) -> None:
        """Apply `edits` to fp32 `logits` in place; after repetition, penalties or DRY every logit is kept
        finite (an extreme penalty overflows), so the softmax stays a distribution."""
        device = logits.device
        bounds = [0]
        for n in edits.phases:
            bounds.append(bounds[-1] + n)
        big = torch.finfo(logits.dtype).max
        for phase in range(4):
            lo, hi = bounds[phase], bounds[phase + 1]
            if lo == hi:
                continue
            index = (edits.rows[lo:hi].to(device), edits.tokens[lo:hi].to(device))
            values = edits.values[lo:hi].to(device, logits.dtype)
            if phase == 1:
                vals = logits[index]
                logits[index] = torch.where(vals > 0, vals / values, vals * values)
            else:
                logits.index_put_(index, values, accumulate=True)
            if phase == 3 or phase == (2 if edits.phases[2] else 1):  # after the penalties, after DRY
                logits.clamp_(-big, big)

    @staticmethod
    def sample_tokens(
        logits: torch.Tensor,  # [rows, vocab]
        settings: torch.Tensor,  # fp64 [rows, 4]: temperature (0: greedy), top_p, min_p, top_k (<= 0: off)
        streams: torch.Tensor,  # int64 [rows, 2]: Philox key and counter
        masks: torch.Tensor | None,  # int32 [rows, ceil(vocab / 32)]: allowed-token bits, or None
    ) -> torch.Tensor:
        """One token per row by the rule kernels/cpu/csrc/sampling.cpp states, computed by sorting, in float64: the
        reference its kernel is tested against (and the sampler where the kernel is not built)."""
        cut = _reference_cut(logits, settings, masks)
        return _draw(cut.keep, cut.weights, cut.top, cut.drawn, streams)

    @staticmethod
    def sample_chain(
        logits: torch.Tensor,  # [rows, vocab]
        settings: torch.Tensor,  # fp64 [rows, 12]: engine/runner/chain.py's pack()
        streams: torch.Tensor,  # int64 [rows, 2]: Philox key and counter
        masks: torch.Tensor | None,  # int32 [rows, ceil(vocab / 32)]: allowed-token bits, or None
    ) -> torch.Tensor:
        """fp64 [rows, 2]: each row's token and Mirostat mu by the chain of top-nσ, typical-p, XTC or Mirostat
        (engine/runner/chain.py, in NumPy: the twin kernels/cpu/csrc/sampling_chain.cpp is tested against)."""
        from minibatch.engine.runner.chain import sample_chain

        return sample_chain(logits, settings, streams, masks)

    @staticmethod
    def sample_cuts(logits, settings, streams, masks) -> torch.Tensor:
        """What the rule keeps per row: int64 [rows, 2], how many tokens and the last of them in the order."""
        cut = _reference_cut(logits, settings, masks)
        count = cut.keep.sum(dim=-1)  # the kept tokens are a prefix of the order
        last = cut.order.gather(1, (count - 1).clamp(min=0)[:, None]).squeeze(1)
        ones = torch.ones_like(count)
        return torch.stack([torch.where(cut.drawn, count, ones), torch.where(cut.drawn, last, cut.top)], dim=1)


@dataclass
class _Cut:
    keep: torch.Tensor  # bool [rows, vocab]: the tokens the rule keeps
    weights: torch.Tensor  # fp64 [rows, vocab]: exp((logit - max) / temperature)
    order: torch.Tensor  # int64 [rows, vocab]: the tokens by logit, the lower id first among ties
    top: torch.Tensor  # int64 [rows]: the argmax
    drawn: torch.Tensor  # bool [rows]: sampled (else the argmax is taken)


def _draw(keep, weights, top, drawn, streams) -> torch.Tensor:
    """Each row's token: its kept weights' distribution function inverted in id order at Philox's uniform."""
    from minibatch.engine.runner.philox import uniforms

    n, device = keep.shape[1], keep.device
    c = (weights * keep).cumsum(dim=-1)
    u = torch.from_numpy(uniforms(streams[:, 0].cpu().numpy(), streams[:, 1].cpu().numpy())).to(device)
    at = torch.searchsorted(c, (u * c[:, -1])[:, None], right=True).squeeze(1)
    last = (c == c[:, -1:]).int().argmax(dim=-1)  # where rounding leaves the target past every sum
    return torch.where(drawn, torch.where(at < n, at, last), top)


def _masked(logits: torch.Tensor, masks: torch.Tensor | None) -> torch.Tensor:
    x = logits.double()
    if masks is not None:
        rows, n = x.shape
        bits = masks.to(x.device).unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=x.device)
        x = x.masked_fill(~(bits & 1).bool().reshape(rows, -1)[:, :n], float("-inf"))
    return x


def _ln_min_p(min_p: torch.Tensor) -> torch.Tensor:
    """ln min_p per row, -inf where min-p is off: on the settings' device, no copy to the host."""
    return torch.where(min_p > 0, min_p.clamp(min=torch.finfo(min_p.dtype).tiny).log(), -math.inf)


def _reference_cut(logits: torch.Tensor, settings: torch.Tensor, masks: torch.Tensor | None) -> _Cut:
    """The sampling rule by sorting, in float64 (kernels/cpu/csrc/sampling.cpp states it)."""
    rows, n = logits.shape
    device = logits.device
    x = _masked(logits, masks)
    temp, top_p, min_p, top_k = settings.to(device).unbind(1)
    top = x.argmax(dim=-1)
    m = x.gather(1, top[:, None])
    drawn = torch.isfinite(m.squeeze(1)) & (temp > 0)
    z = (x - m) / torch.where(drawn, temp, 1.0)[:, None]
    w = torch.exp(z)  # a -inf logit weighs 0
    xs, order = x.sort(dim=-1, descending=True, stable=True)  # the order: higher logit, then lower id
    k = torch.where((top_k > 0) & (top_k < n), top_k, float(n)).long()
    keep = (x >= xs.gather(1, (k - 1)[:, None])) & (x > float("-inf"))  # ties with the k-th kept
    wk = w * keep
    ws = wk.gather(1, order)
    before = ws.cumsum(dim=-1) - ws
    dropped = before >= (top_p * wk.sum(dim=-1))[:, None]
    keep &= ~torch.zeros_like(dropped).scatter(1, order, dropped) | (top_p >= 1)[:, None]
    ln_min_p = _ln_min_p(min_p)
    keep &= z >= ln_min_p[:, None]
    return _Cut(keep, w, order, top, drawn)


_no_masks = torch.empty(0, dtype=torch.int32)


class CpuOps(TorchOps):
    """The same operations as single-pass C++ kernels (fp32 CPU); TorchOps is their twin."""

    name = "cpu-kernels"

    def __init__(self, ext) -> None:
        self.ext = ext

    def rms_norm(self, x, weight, eps):
        return self.ext.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        residual = residual.contiguous()
        return self.ext.add_rms_norm(x, residual, weight, eps), residual

    def rotary(self, positions, q, k, cos, sin):
        self.ext.rotary_inplace(positions, q, k, cos, sin)
        return q, k

    def silu_mul(self, gate_up):
        return self.ext.silu_mul(gate_up)

    def lora_update(self, y, x, a, bt, ranks, slots, scales):
        """On the kernels' pool, each row in one fixed order (lora.cpp), y updated in place."""
        y = y.contiguous()
        self.ext.lora_update(y, x.contiguous(), a, bt, ranks, slots, scales)
        return y

    def argmax_rows(self, x):
        """On the kernels' pool: torch's argmax over two rows or more runs an OpenMP region, whose threads
        spin on after it (libgomp's wait) and take a core from the pool's worker for the rest of a small
        step; a decode step of two rows, or one row verifying one draft token, ran 1.5 times as long so."""
        return self.ext.argmax_rows(x.float())

    def sample_tokens(self, logits, settings, streams, masks):
        """One fused pass per row on the pool (sampling.cpp): no sort of the vocabulary, no tensor per step
        beyond the output, where the twin's dozen ops over it each ran a parallel region."""
        return self.ext.sample_tokens(logits.float(), settings, streams, _no_masks if masks is None else masks)

    def sample_cuts(self, logits, settings, streams, masks):
        return self.ext.sample_cuts(logits.float(), settings, streams, _no_masks if masks is None else masks)

    def sample_chain(self, logits, settings, streams, masks):
        """The chain as one C++ pass per row (sampling_chain.cpp): a scan of the vocabulary and a sort of the
        few candidates, where the twin converts the row to float64 in NumPy first."""
        return self.ext.sample_chain(logits.float(), settings, streams, _no_masks if masks is None else masks)


class TritonOps(TorchOps):
    """The same operations as fused Triton kernels (GPU, or the interpreter in tests)."""

    name = "triton"

    @staticmethod
    def edit_logits(logits, edits):
        """One launch per phase present (kernels/gpu/sampling.py), the entries sent up in two copies."""
        from minibatch.kernels.gpu.logit_edits import edit_logits

        edit_logits(logits, edits.rows, edits.tokens, edits.values, edits.phases)

    @staticmethod
    def sample_tokens(logits, settings, streams, masks):
        """One Triton program per row (kernels/gpu/sampling.py): the rule's cuts found by searching the logits'
        values, no sort of the vocabulary, the Philox draw on the device; one launch for the batch."""
        from minibatch.kernels.gpu.sampling import sample_rows

        return sample_rows(logits, settings, streams, masks)[0]

    @staticmethod
    def sample_cuts(logits, settings, streams, masks):
        from minibatch.kernels.gpu.sampling import sample_rows

        return sample_rows(logits, settings, streams, masks)[1][:, :2]

    @staticmethod
    def rms_norm(x, weight, eps):
        from minibatch.kernels.gpu.rmsnorm import fused_add_rmsnorm

        return fused_add_rmsnorm(x, torch.zeros_like(x), weight, eps)

    @staticmethod
    def add_rms_norm(x, residual, weight, eps):
        from minibatch.kernels.gpu.rmsnorm import fused_add_rmsnorm

        residual = residual.contiguous()
        out = fused_add_rmsnorm(x.contiguous(), residual, weight, eps)  # residual becomes residual + x
        return out, residual

    @staticmethod
    def rotary(positions, q, k, cos, sin):
        from minibatch.kernels.gpu.rotary import rotary_inplace

        rotary_inplace(q, k, positions, cos, sin)
        return q, k

    @staticmethod
    def silu_mul(gate_up):
        from minibatch.kernels.gpu.activation import silu_and_mul

        return silu_and_mul(gate_up.contiguous())

    @staticmethod
    def lora_update(y, x, a, bt, ranks, slots, scales):
        """One launch per projection (kernels/gpu/lora.py): each row on its own, y updated in place."""
        from minibatch.kernels.gpu.lora import lora_update

        return lora_update(y.contiguous(), x.contiguous(), a, bt, ranks, slots, scales)

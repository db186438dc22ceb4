"""The model's elementwise pieces behind one small interface: PyTorch twins (CPU) or Triton kernels (GPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:  # GeGLU (Gemma): gelu(gate, tanh approx.) * up
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    @staticmethod
    def argmax_rows(x: torch.Tensor) -> torch.Tensor:  # [rows, vocab] -> int64 [rows]: the sampler's argmax
        """Each row's argmax, the first of ties (a NaN counts as the largest)."""
        return x.argmax(dim=-1)

    @staticmethod
    def sample_rows(logits: torch.Tensor, inv_temps: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """One draw per row from softmax(logits * inv_temp), the distribution function inverted at u in [0, 1)
        (a -inf logit is never drawn); a row whose largest logit is not finite, or whose inv_temp is infinite
        (temperature 0), gives its argmax."""
        top = logits.argmax(dim=-1)
        m = logits.gather(1, top[:, None])
        w = torch.exp((logits - m) * inv_temps[:, None]).masked_fill(logits == float("-inf"), 0.0)
        c = w.double().cumsum(dim=-1)
        at = torch.searchsorted(c, (u.double() * c[:, -1])[:, None], right=True).squeeze(1)
        drawn = torch.isfinite(m.squeeze(1)) & ~torch.isinf(inv_temps)
        return torch.where(drawn, at.clamp(max=logits.shape[1] - 1), top)


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

    def argmax_rows(self, x):
        """On the kernels' pool: torch's argmax over two rows or more runs an OpenMP region, whose threads
        spin on after it (libgomp's wait) and take a core from the pool's worker for the rest of a small
        step; a decode step of two rows, or one row verifying one draft token, ran 1.5 times as long so."""
        return self.ext.argmax_rows(x.float())

    def sample_rows(self, logits, inv_temps, u):
        """One pass per row on the pool, where the twin's half a dozen ops over the vocabulary each ran a
        parallel region (a temperature-sampled row cost a batch-1 step about 4 ms so)."""
        return self.ext.sample_rows(logits.float(), inv_temps.float().contiguous(), u.float().contiguous())


class TritonOps(TorchOps):
    """The same operations as fused Triton kernels (GPU, or the interpreter in tests)."""

    name = "triton"

    @staticmethod
    def rms_norm(x, weight, eps):
        from minibatch.kernels.rmsnorm import fused_add_rmsnorm

        return fused_add_rmsnorm(x, torch.zeros_like(x), weight, eps)

    @staticmethod
    def add_rms_norm(x, residual, weight, eps):
        from minibatch.kernels.rmsnorm import fused_add_rmsnorm

        residual = residual.contiguous()
        out = fused_add_rmsnorm(x.contiguous(), residual, weight, eps)  # residual becomes residual + x
        return out, residual

    @staticmethod
    def rotary(positions, q, k, cos, sin):
        from minibatch.kernels.rotary import rotary_inplace

        rotary_inplace(q, k, positions, cos, sin)
        return q, k

    @staticmethod
    def silu_mul(gate_up):
        from minibatch.kernels.activation import silu_and_mul

        return silu_and_mul(gate_up.contiguous())

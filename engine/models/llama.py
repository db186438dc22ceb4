"""Llama-family decoder (Llama, Mistral-style, Qwen2 q/k/v bias) over a flat token batch.

Each forward runs the new tokens of many sequences packed end to end, with
per-token positions; K/V go into the paged cache through the attention backend.
Parameter names follow Hugging Face, except that q/k/v and gate/up are stored
stacked (`qkv_proj`, `gate_up_proj`) so each is one matrix multiply.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionBackend, AttentionMetadata
from .config import ModelConfig, RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, dim]
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] inverse frequencies, computed in fp32 as Hugging Face does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type != "llama3":
        return inv_freq
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) rotary embedding with a cos/sin table per position."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position: int) -> None:
        super().__init__()
        self.rope, self.head_dim, self.max_position = rope, head_dim, max_position
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def build_tables(self, device: torch.device) -> None:
        inv_freq = rope_inv_freq(self.rope, self.head_dim).to(device)
        t = torch.arange(self.max_position, device=device, dtype=torch.float32)
        freqs = t[:, None] * inv_freq[None, :]  # [max_position, head_dim // 2]
        self.cos, self.sin = freqs.cos(), freqs.sin()

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # positions: [num_tokens]; x: [num_tokens, heads, head_dim]
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)  # [num_tokens, 1, head_dim // 2]
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.rotary, self.backend = rotary, backend
        self.scale = cfg.head_dim**-0.5

    def forward(self, positions, x, kv_cache, meta: AttentionMetadata):
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.rotary(positions, q.view(n, self.num_heads, self.head_dim))
        k = self.rotary(positions, k.view(n, self.num_kv_heads, self.head_dim))
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(n, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, rotary, backend)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, kv_cache, meta):
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.rotary, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The model: `forward` runs a flat batch into the cache, `compute_logits` scores hidden states."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config, self.backend = cfg, backend
        self.model = LlamaBody(cfg, backend)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.logits_proj: nn.Module | None = None  # a packed output projection, when the CPU path made one

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden] after the final norm
        self.backend.prepare(meta)
        x = self.model.embed_tokens(input_ids)
        for layer, cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(positions, x, cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        if self.logits_proj is not None:
            return self.logits_proj(hidden)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)

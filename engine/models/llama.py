"""Decoder for the Llama family and its relatives (Mistral, Qwen2/3, Phi-3, Gemma 2/3) over a flat token batch.

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

from minibatch.engine.attention.metadata import AttentionBackend, AttentionMetadata
from minibatch.engine.core.outputs import StepAbandoned
from minibatch.engine.lora.rows import LayerLora, LoraSet
from minibatch.engine.models.config import ModelConfig, RopeConfig
from minibatch.engine.models.ops import TorchOps
from minibatch.kernels.kv_types import PagedKV


class RMSNorm(nn.Module):
    """Holds the norm's weight; the computation is the ops' rms_norm / add_rms_norm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


def rope_inv_freq(rope: RopeConfig, head_dim: int, long: bool = False) -> torch.Tensor:
    """[head_dim // 2] inverse frequencies, computed in fp32 as Hugging Face does (LongRoPE: the short
    factors, or with `long` the long ones)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if rope.rope_type == "longrope":
        factors = rope.long_factor if long else rope.short_factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta**exponents)
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
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
        self.long = False

    def build_tables(self, device: torch.device, long: bool = False, length: int | None = None) -> None:
        """cos/sin for positions 0..length-1 (default: the model's context); `long`: LongRoPE's long factors."""
        self.long = long
        inv_freq = rope_inv_freq(self.rope, self.head_dim, long).to(device)
        t = torch.arange(length or self.max_position, device=device, dtype=torch.float32)
        freqs = t[:, None] * inv_freq[None, :]  # [max_position, head_dim // 2]
        self.cos, self.sin = freqs.cos(), freqs.sin()
        if self.rope.attention_factor != 1.0:  # LongRoPE scales the rotation's output
            self.cos, self.sin = self.cos * self.rope.attention_factor, self.sin * self.rope.attention_factor


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend, ops: TorchOps) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.rotary, self.backend = rotary, backend
        self.scale = cfg.query_scale or cfg.head_dim**-0.5
        self.eps = cfg.rms_norm_eps
        # Qwen3: RMSNorm over each head of q and k, before rotary
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.lora: LayerLora | None = None  # LoRA adapters' updates of qkv and o (LlamaForCausalLM.attach_loras)

    def forward(self, positions, x, kv_cache, meta: AttentionMetadata):
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.lora is not None:
            qkv = self.lora("qkv", x, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.reshape(n, self.num_heads, self.head_dim), k.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.ops.rms_norm(q.reshape(-1, self.head_dim), self.q_norm.weight, self.eps).view(
                n, self.num_heads, self.head_dim
            )
            k = self.ops.rms_norm(k.reshape(-1, self.head_dim), self.k_norm.weight, self.eps).view(
                n, self.num_kv_heads, self.head_dim
            )
        q, k = self.ops.rotary(positions, q, k, self.rotary.cos, self.rotary.sin)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale).reshape(n, self.q_size)
        return self.o_proj(out) if self.lora is None else self.lora("o", out, self.o_proj(out))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: TorchOps) -> None:
        super().__init__()
        self.ops = ops
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

        self.gelu = cfg.hidden_act == "gelu_tanh"
        self.lora: LayerLora | None = None  # LoRA adapters' updates of gate/up and down (attach_loras)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if self.lora is not None:
            gate_up = self.lora("gate_up", x, gate_up)
        act = self.ops.gelu_tanh_mul(gate_up) if self.gelu else self.ops.silu_mul(gate_up)
        return self.down_proj(act) if self.lora is None else self.lora("down", act, self.down_proj(act))


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend, ops: TorchOps, window: int = 0
    ) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, rotary, backend, ops)
        self.mlp = MLP(cfg, ops)
        self.window = window
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Llama: the norm before the MLP. Gemma: the norm of the attention's output, with two more around the MLP.
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaBody(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, ops: TorchOps) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position)
        # Gemma 3's sliding layers rotate with a base of their own
        self.rotary_local = RotaryEmbedding(cfg.rope_local, cfg.head_dim, cfg.max_position) if cfg.rope_local else None
        # An explicit (uninitialised) weight skips the random init, whose first use on the meta
        # device imports torch._refs (~3 s of every start).
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(
            DecoderLayer(
                cfg,
                self.rotary_local if self.rotary_local is not None and cfg.window_of(i) else self.rotary,
                backend,
                ops,
                cfg.window_of(i),
            )
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The model: `forward` runs a flat batch into the cache, `compute_logits` scores hidden states."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, ops: TorchOps | None = None) -> None:
        super().__init__()
        self.config, self.backend = cfg, backend
        self.ops = ops or TorchOps()
        self.model = LlamaBody(cfg, backend, self.ops)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # a reranker's head (pooling rank): the rows that score its last token
        self.score = nn.Linear(cfg.hidden_size, cfg.score_labels, bias=False) if cfg.pooling == "rank" else None
        self.rank_from_first = False  # a decoder reranks from its last token (an encoder from its first)
        self.logits_proj: nn.Module | None = None  # a packed or quantized output projection (CPU paths)
        self.weights_desc = "float32"  # what the matrices run as, for /health and the panel
        self.loras: LoraSet | None = None  # the LoRA adapters it serves (attach_loras)
        # this step's image positions: (their rows in the flat batch, the images' embeddings for them), which
        # take the place of the placeholder tokens' embeddings (set by the runner for one forward)
        self.image_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def attach_loras(self, device: torch.device) -> LoraSet:
        """The model's LoraSet, made on first use: every layer's attention and MLP then add the updates of the
        step's adapters to their rows."""
        if self.loras is None:
            self.loras = LoraSet(device, self.ops)
            for i, layer in enumerate(self.model.layers):
                layer.self_attn.lora = layer.mlp.lora = LayerLora(self.loras, i)
        return self.loras

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[PagedKV],  # per layer: K and V, each [num_blocks, block_size, num_kv_heads, row]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden] after the final norm
        cfg = self.config
        meta.softcap = cfg.attn_softcap
        if cfg.layer_windows:  # windows differ by layer: one plan per window, chosen layer by layer
            meta.plans = {}
            for w in sorted(set(cfg.layer_windows)):
                meta.window = w
                self.backend.prepare(meta)
                meta.plans[w] = meta.plan
        else:
            meta.window = cfg.sliding_window or 0
            self.backend.prepare(meta)
        return self.forward_planned(input_ids, positions, kv_caches, meta)

    def forward_planned(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """The forward once `meta.plan` is built (CUDA graphs capture this part with static buffers)."""
        if self.config.sandwich_norms:
            return self._forward_sandwich(input_ids, positions, kv_caches, meta)
        ops, eps, layers = self.ops, self.config.rms_norm_eps, self.model.layers
        residual = self._with_images(self.model.embed_tokens(input_ids))
        h = ops.rms_norm(residual, layers[0].input_layernorm.weight, eps)
        # Each residual add is fused with the norm that follows it (the next layer's, or the final one).
        for i, (layer, cache) in enumerate(zip(layers, kv_caches, strict=True)):
            if meta.abandon is not None and meta.abandon():
                raise StepAbandoned(f"abandoned at layer {i}")
            attn = layer.self_attn(positions, h, cache, meta)
            h, residual = ops.add_rms_norm(attn, residual, layer.post_attention_layernorm.weight, eps)
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            h, residual = ops.add_rms_norm(layer.mlp(h), residual, nxt.weight, eps)
        return h

    def _with_images(self, embeds: torch.Tensor) -> torch.Tensor:
        """The input embeddings with the step's image positions taking the images' (after Gemma's scale, which
        only token embeddings get)."""
        if self.image_rows is None:
            return embeds
        index, rows = self.image_rows
        return embeds.index_copy(0, index, rows.to(embeds.dtype))

    def _forward_sandwich(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """Gemma's layer: norm, attention, norm, add; norm, MLP, norm, add (the norms' weights hold 1 + w)."""
        ops, cfg, layers = self.ops, self.config, self.model.layers
        eps = cfg.rms_norm_eps
        residual = self.model.embed_tokens(input_ids)
        residual = self._with_images(residual * torch.tensor(cfg.embed_scale, dtype=residual.dtype))
        h = ops.rms_norm(residual, layers[0].input_layernorm.weight, eps)
        for i, (layer, cache) in enumerate(zip(layers, kv_caches, strict=True)):
            if meta.abandon is not None and meta.abandon():
                raise StepAbandoned(f"abandoned at layer {i}")
            if cfg.layer_windows:
                meta.window, meta.plan = layer.window, meta.plans[layer.window]
            attn = ops.rms_norm(layer.self_attn(positions, h, cache, meta), layer.post_attention_layernorm.weight, eps)
            h, residual = ops.add_rms_norm(attn, residual, layer.pre_feedforward_layernorm.weight, eps)
            mlp = ops.rms_norm(layer.mlp(h), layer.post_feedforward_layernorm.weight, eps)
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            h, residual = ops.add_rms_norm(mlp, residual, nxt.weight, eps)
        return h

    def use_context(self, max_len: int, positions: int | None = None) -> None:
        """Rotary tables for contexts up to `max_len` positions. Past LongRoPE's original length every
        position rotates with the long factors, decided here once for the whole run (as llama.cpp decides
        by its context size), so the cached keys never mix the two. `positions`: the tables hold only this
        many (the most a sequence can reach, when the KV pool holds fewer tokens than `max_len`: a 512-token
        pool needs 512 rows, not the 131,072 of Llama 3.2's context, 34 MB of cos and sin)."""
        length = min(max_len, positions or max_len)
        rotary = self.model.rotary
        long = rotary.rope.rope_type == "longrope" and max_len > rotary.rope.original_max_position
        if long != rotary.long or length != rotary.cos.shape[0]:
            rotary.build_tables(rotary.cos.device, long=long, length=length)
        local = self.model.rotary_local
        if local is not None and length != local.cos.shape[0]:
            local.build_tables(local.cos.device, length=length)

    def projections(self):
        """(group, module) for every matrix multiply one token's forward runs, in order: each layer's
        attention and MLP projections, then the output projection (None: the plain weight that
        `compute_logits` multiplies by, the embedding's when tied)."""
        for layer in self.model.layers:
            yield "attention", layer.self_attn.qkv_proj
            yield "attention", layer.self_attn.o_proj
            yield "mlp", layer.mlp.gate_up_proj
            yield "mlp", layer.mlp.down_proj
        yield "output", self.logits_proj if self.logits_proj is not None else (self.lm_head or self.model.embed_tokens)

    def classify(self, last: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, 1]: the relevance
        """A decoder reranker's score of its last token: with two rows ("yes", "no"), the first's share of their
        softmax (llama.cpp's Qwen3 rank pooling); with one, its logit."""
        if self.score is None:
            raise ValueError("this model has no score head (it is not a reranker)")
        logits = F.linear(last, self.score.weight)
        return logits.softmax(-1)[:, :1] if logits.shape[-1] == 2 else logits

    def embedding_tables(self) -> list[nn.Module]:
        return [self.model.embed_tokens]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        if self.logits_proj is not None:
            logits = self.logits_proj(hidden)
        else:
            weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(hidden, weight)
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

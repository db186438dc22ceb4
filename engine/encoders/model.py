"""The encoder's forward (BERT, RoBERTa, XLM-RoBERTa, NomicBERT) over a flat batch of whole inputs, and its heads.

The runner calls it as it calls a decoder (engine/runner/model_runner.py): the new tokens of many sequences end
to end, their positions, the (empty) KV caches and the batch's metadata, and gets the last layer's hidden
states back, which it pools. Every input is computed whole in one step (the scheduler's whole_prompts: an
encoder attends both ways, so a chunk could not see the tokens after it), and each attends only to itself, so
a row's result does not depend on what else is in the batch. Post-norm layers: attention, add, LayerNorm;
MLP (GELU, or NomicBERT's SwiGLU), add, LayerNorm; NomicBERT rotates q and k (rotate-half) by position instead
of adding learned position embeddings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minibatch.engine.attention.metadata import AttentionMetadata
from minibatch.engine.core.outputs import StepAbandoned
from minibatch.engine.encoders.config import EncoderConfig
from minibatch.engine.models.ops import TorchOps


class EncoderLayer(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        h, bias = cfg.hidden_size, cfg.bias
        self.qkv = nn.Linear(h, 3 * h, bias=bias)
        self.out = nn.Linear(h, h, bias=bias)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.up = nn.Linear(h, cfg.intermediate_size, bias=bias)
        self.gate = nn.Linear(h, cfg.intermediate_size, bias=bias) if cfg.gated_mlp else None
        self.down = nn.Linear(cfg.intermediate_size, h, bias=bias)
        self.mlp_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)


class ClassificationHead(nn.Module):
    """BERT's: tanh(pooler(first)) -> classifier. RoBERTa's: out_proj(tanh(dense(first)))."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def forward(self, first: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, num_labels]
        return self.out(torch.tanh(self.dense(first)))


class EncoderModel(nn.Module):
    def __init__(self, cfg: EncoderConfig, ops: TorchOps | None = None) -> None:
        super().__init__()
        self.config, self.ops = cfg, ops or TorchOps()
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h, _weight=torch.empty(cfg.vocab_size, h))
        rows = cfg.max_position + cfg.position_offset
        self.position_embeddings = (
            nn.Embedding(rows, h, _weight=torch.empty(rows, h)) if cfg.rope_theta is None else None
        )
        self.register_buffer("cos", torch.empty(0), persistent=False)  # rotary tables [positions, head_dim / 2]
        self.register_buffer("sin", torch.empty(0), persistent=False)
        types = cfg.type_vocab_size
        self.token_type_embeddings = nn.Embedding(types, h, _weight=torch.empty(types, h))
        self.embed_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))
        self.head = ClassificationHead(cfg) if cfg.pooling == "rank" else None
        self.rank_from_first = True  # the head reads the first token ([CLS], <s>)
        self.weights_desc = "float32"

    def build_rotary(self, device: torch.device | str) -> None:
        """cos and sin for every position, in float32 as the decoders' tables are (NomicBERT)."""
        cfg = self.config
        if cfg.rope_theta is None:
            return
        d = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        freqs = torch.arange(cfg.max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.cos, self.sin = freqs.cos().to(device), freqs.sin().to(device)

    def token_types(self, input_ids: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """0 up to and including each input's first separator, 1 after it (a pair's second text), as the
        tokenizer's pair encoding marks them; all 0 for a model with one type."""
        cfg = self.config
        if cfg.type_vocab_size < 2 or cfg.sep_token_id is None:
            return torch.zeros_like(input_ids)
        seps = (input_ids == cfg.sep_token_id).to(torch.int64)
        types = []
        for part in seps.split(lens):
            before = part.cumsum(0) - part  # separators strictly before each token
            types.append((before > 0).to(torch.int64))
        return torch.cat(types)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]: from 0 in each input
        kv_caches: list,  # unused: nothing is cached
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]: the last layer's states
        cfg = self.config
        lens = meta.query_lens
        if lens != meta.seq_lens:
            raise ValueError("an encoder computes each input whole in one step (the scheduler's whole_prompts)")
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(self.token_types(input_ids, lens))
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(positions + cfg.position_offset)
        x = self.embed_norm(x)
        n, heads, d = x.shape[0], cfg.num_heads, cfg.head_dim
        for i, layer in enumerate(self.layers):
            if meta.abandon is not None and meta.abandon():
                raise StepAbandoned(f"abandoned at layer {i}")
            q, k, v = layer.qkv(x).view(n, 3, heads, d).unbind(1)
            if cfg.rope_theta is not None:
                q, k = self.ops.rotary(positions, q.contiguous(), k.contiguous(), self.cos, self.sin)
            parts = []
            for qs, ks, vs in zip(q.split(lens), k.split(lens), v.split(lens)):
                out = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1))
                parts.append(out.transpose(0, 1).reshape(-1, heads * d))
            x = layer.attn_norm(x + layer.out(torch.cat(parts)))
            up = layer.up(x)
            if layer.gate is not None:
                act = F.silu(layer.gate(x)) * up
            else:
                act = F.gelu(up, approximate="tanh" if cfg.gelu_tanh else "none")
            x = layer.mlp_norm(x + layer.down(act))
        return x

    def classify(self, first: torch.Tensor) -> torch.Tensor:  # [n, hidden] first tokens -> [n, num_labels]
        if self.head is None:
            raise ValueError("this encoder has no classification head (it embeds)")
        return self.head(first)

    def embedding_tables(self) -> list[nn.Module]:
        tables = [self.word_embeddings, self.position_embeddings, self.token_type_embeddings]
        return [t for t in tables if t is not None]

    def projections(self):
        """(group, module) for every matrix multiply of a token's forward, as the decoder lists them."""
        for layer in self.layers:
            yield "attention", layer.qkv
            yield "attention", layer.out
            yield "mlp", layer.up
            if layer.gate is not None:
                yield "mlp", layer.gate
            yield "mlp", layer.down
        if self.head is not None:
            yield "output", self.head.dense
            yield "output", self.head.out

"""The encoder's forward (BERT, RoBERTa, XLM-RoBERTa) over a flat batch of whole inputs, and its heads.

The runner calls it as it calls a decoder (engine/runner/model_runner.py): the new tokens of many sequences end
to end, their positions, the (empty) KV caches and the batch's metadata, and gets the last layer's hidden
states back, which it pools. Every input is computed whole in one step (the scheduler's whole_prompts: an
encoder attends both ways, so a chunk could not see the tokens after it), and each attends only to itself, so
a row's result does not depend on what else is in the batch. Post-norm layers: attention, add, LayerNorm;
MLP (GELU), add, LayerNorm.
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
        h = cfg.hidden_size
        self.qkv = nn.Linear(h, 3 * h)
        self.out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.up = nn.Linear(h, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, h)
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
        self.position_embeddings = nn.Embedding(rows, h, _weight=torch.empty(rows, h))
        types = cfg.type_vocab_size
        self.token_type_embeddings = nn.Embedding(types, h, _weight=torch.empty(types, h))
        self.embed_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))
        self.head = ClassificationHead(cfg) if cfg.pooling == "rank" else None
        self.weights_desc = "float32"

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
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions + cfg.position_offset)
            + self.token_type_embeddings(self.token_types(input_ids, lens))
        )
        x = self.embed_norm(x)
        n, heads, d = x.shape[0], cfg.num_heads, cfg.head_dim
        for i, layer in enumerate(self.layers):
            if meta.abandon is not None and meta.abandon():
                raise StepAbandoned(f"abandoned at layer {i}")
            q, k, v = layer.qkv(x).view(n, 3, heads, d).unbind(1)
            parts = []
            for qs, ks, vs in zip(q.split(lens), k.split(lens), v.split(lens)):
                out = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1))
                parts.append(out.transpose(0, 1).reshape(-1, heads * d))
            x = layer.attn_norm(x + layer.out(torch.cat(parts)))
            up = layer.up(x)
            act = F.gelu(up, approximate="tanh" if cfg.gelu_tanh else "none")
            x = layer.mlp_norm(x + layer.down(act))
        return x

    def classify(self, first: torch.Tensor) -> torch.Tensor:  # [n, hidden] first tokens -> [n, num_labels]
        if self.head is None:
            raise ValueError("this encoder has no classification head (it embeds)")
        return self.head(first)

    def embedding_tables(self) -> list[nn.Module]:
        return [self.word_embeddings, self.position_embeddings, self.token_type_embeddings]

    def projections(self):
        """(group, module) for every matrix multiply of a token's forward, as the decoder lists them."""
        for layer in self.layers:
            yield "attention", layer.qkv
            yield "attention", layer.out
            yield "mlp", layer.up
            yield "mlp", layer.down
        if self.head is not None:
            yield "output", self.head.dense
            yield "output", self.head.out

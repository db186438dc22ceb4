"""Put block-quantized weights into a model built on the meta device: GGUF tensors as they are,
or a fp32 model's matrices quantized at load."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from torch import nn

from minibatch.engine.gguf.tensors import GGUFTensor, GGUFWeights
from minibatch.engine.models.llama import LlamaForCausalLM
from minibatch.engine.weights.cpu_linear import PackedLinear, packed_linear_available
from minibatch.engine.weights.quant_linear import QuantEmbedding, QuantLinear, StackedLinear
from minibatch.kernels.quant_types import QUANT_TYPES, QuantType

_STACKS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def install_gguf_weights(model: LlamaForCausalLM, gw: GGUFWeights, packed: bool = True, int8: bool = True) -> None:
    """Fill `model` (on meta) from `gw`: matrices stay quantized, norms become fp32 parameters.
    `int8`: the block-quantized matrices multiply 8-bit activations in integers (else fp32, exactly)."""
    cfg, t = model.config, gw.tensors
    pack = packed and packed_linear_available()
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        for stacked, parts in _STACKS.items():
            if f"{prefix}{stacked}.weight" in t:  # stored fused (Phi-3)
                parts = (stacked,)
            weights = [t[f"{prefix}{p}.weight"] for p in parts]
            biases = [t.get(f"{prefix}{p}.bias") for p in parts]
            _set(layer, stacked, _linear(weights, biases, pack, int8))
        norms = ("input_layernorm", "post_attention_layernorm")
        if cfg.sandwich_norms:  # Gemma
            norms += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
        for norm in norms:
            getattr(layer, norm).weight = nn.Parameter(t[f"{prefix}{norm}.weight"].dequantized(), requires_grad=False)
        if cfg.qk_norm:  # Qwen3's per-head q/k norms
            for norm in ("q_norm", "k_norm"):
                getattr(layer.self_attn, norm).weight = nn.Parameter(
                    t[f"{prefix}self_attn.{norm}.weight"].dequantized(), requires_grad=False
                )
    model.model.norm.weight = nn.Parameter(t["model.norm.weight"].dequantized(), requires_grad=False)
    if model.score is not None:  # a reranker's few rows, in float32
        model.score.weight = nn.Parameter(t["score.weight"].dequantized(), requires_grad=False)
    emb = t["model.embed_tokens.weight"]
    if emb.qtype.name == "F32":
        model.model.embed_tokens = nn.Embedding.from_pretrained(emb.dequantized(), freeze=True)
    else:
        model.model.embed_tokens = QuantEmbedding(emb.blocks(), emb.qtype, cfg.hidden_size)
    if (cfg.tie_word_embeddings or "lm_head.weight" not in t) and isinstance(model.model.embed_tokens, QuantEmbedding):
        model.logits_proj = model.model.embed_tokens.as_linear(int8)  # one copy of the blocks for both
    elif cfg.tie_word_embeddings or "lm_head.weight" not in t:
        model.logits_proj = _linear([emb], [None], pack, int8)
    else:
        model.logits_proj = _linear([t["lm_head.weight"]], [None], pack, int8)
    model.lm_head = None


def _linear(weights: list[GGUFTensor], biases: list[GGUFTensor | None], pack: bool, int8: bool) -> nn.Module:
    """One module computing the stacked projections; one kernel call when every part has one type."""
    k = weights[0].shape[-1]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat(
            [b.dequantized() if b is not None else torch.zeros(w.shape[0]) for w, b in zip(weights, biases)]
        )
    if all(w.qtype.name == "F32" for w in weights):
        dense = torch.cat([w.dequantized() for w in weights])
        if pack:
            return PackedLinear(dense, bias)
        lin = nn.Linear(k, dense.shape[0], bias=bias is not None, device="meta")
        lin.weight = nn.Parameter(dense, requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias, requires_grad=False)
        return lin
    if len({w.qtype.name for w in weights}) == 1:
        blocks = weights[0].blocks() if len(weights) == 1 else torch.cat([w.blocks() for w in weights])
        return QuantLinear(blocks, weights[0].qtype, k, bias, int8)
    # Mixed types (Q4_K_M's q and k in Q5_0 beside v in Q8_0): neighbours of one type share a kernel call.
    runs = [list(g) for _, g in itertools.groupby(weights, key=lambda w: w.qtype.name)]
    parts, start = [], 0
    for run in runs:
        n = sum(w.shape[0] for w in run)
        blocks = run[0].blocks() if len(run) == 1 else torch.cat([w.blocks() for w in run])
        parts.append(QuantLinear(blocks, run[0].qtype, k, None if bias is None else bias[start : start + n], int8))
        start += n
    return StackedLinear(parts)


def quantize_blocks(weight: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """[N, K] fp32 -> [N, row_bytes] uint8 GGUF blocks, by gguf's reference quantizer (round to nearest)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    raw = quantize(weight.detach().float().contiguous().numpy(), GGMLQuantizationType(qtype.ggml_id))
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(weight.shape[0], -1))


def quantize_linears(model: LlamaForCausalLM, type_name: str, int8: bool = True) -> None:
    """Quantize every matrix of a loaded fp32 model (embedding and output projection included)."""
    qtype = QUANT_TYPES[type_name]
    for layer in model.model.layers:
        for name in _STACKS:
            lin = _get(layer, name)
            _set(layer, name, QuantLinear(quantize_blocks(lin.weight, qtype), qtype, lin.in_features, lin.bias, int8))
    emb = model.model.embed_tokens.weight
    out = emb if model.lm_head is None else model.lm_head.weight
    model.model.embed_tokens = QuantEmbedding(quantize_blocks(emb, qtype), qtype, emb.shape[1])
    model.logits_proj = (
        model.model.embed_tokens.as_linear(int8)
        if model.lm_head is None
        else QuantLinear(quantize_blocks(out, qtype), qtype, out.shape[1], int8=int8)
    )
    model.lm_head = None


def _get(module: nn.Module, dotted: str) -> nn.Module:
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


def _set(module: nn.Module, dotted: str, value: nn.Module) -> None:
    *path, last = dotted.split(".")
    for part in path:
        module = getattr(module, part)
    setattr(module, last, value)

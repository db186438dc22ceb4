"""An encoder's weights from its Hugging Face safetensors, by name, into EncoderModel's parameters."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from minibatch.engine.encoders.config import EncoderConfig
from minibatch.engine.encoders.model import EncoderModel
from minibatch.engine.models.ops import TorchOps
from minibatch.engine.weights.cpu_linear import pack_linears, packed_linear_available
from minibatch.engine.weights.loader import WeightLoadError, gguf_source

_PREFIXES = ("bert.", "roberta.", "model.")
_QKV = {"query": 0, "key": 1, "value": 2}
WHOLE = -1  # a stacked q/k/v tensor: every shard at once
# checkpoint tensors the forward does not use: buffers, a masked-LM head, a pooler an embedding model skips
_IGNORED = re.compile(r"(position_ids|token_type_ids)$|^(cls|lm_head)\.")
_LAYER = {
    "intermediate.gate": "gate",  # (a GGUF's NomicBERT, engine/encoders/gguf.py)
    "attention.output.dense": "out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "up",
    "output.dense": "down",
    "output.LayerNorm": "mlp_norm",
}
# NomicBERT's layer names (its folder's and, renamed by engine/encoders/gguf.py, its GGUF's); Wqkv is stacked
_NOMIC_LAYER = {
    "attn.out_proj": "out",
    "norm1": "attn_norm",
    "mlp.fc11": "up",
    "mlp.fc12": "gate",
    "mlp.fc2": "down",
    "norm2": "mlp_norm",
}
_TOP = {
    "emb_ln": "embed_norm",
    "embeddings.word_embeddings": "word_embeddings",
    "embeddings.position_embeddings": "position_embeddings",
    "embeddings.token_type_embeddings": "token_type_embeddings",
    "embeddings.LayerNorm": "embed_norm",
}


def _target(key: str, head: str) -> tuple[str, int] | None:
    """(our parameter, its shard: q/k/v's place in the stacked qkv, WHOLE for all three at once, else 0); None:
    not one of ours."""
    for prefix in _PREFIXES:
        key = key.removeprefix(prefix)
    module, _, leaf = key.rpartition(".")
    leaf = {"gamma": "weight", "beta": "bias"}.get(leaf, leaf)  # older LayerNorm names
    if module in _TOP:
        return f"{_TOP[module]}.{leaf}", 0
    m = re.fullmatch(r"encoder\.layers\.(\d+)\.(.+)", module)  # NomicBERT's
    if m:
        layer, rest = m.groups()
        if rest == "attn.Wqkv":
            return f"layers.{layer}.qkv.{leaf}", WHOLE
        return (f"layers.{layer}.{_NOMIC_LAYER[rest]}.{leaf}", 0) if rest in _NOMIC_LAYER else None
    m = re.fullmatch(r"encoder\.layer\.(\d+)\.(.+)", module)
    if m:
        layer, rest = m.groups()
        if rest.startswith("attention.self."):
            part = rest.removeprefix("attention.self.")
            if part == "qkv":
                return f"layers.{layer}.qkv.{leaf}", WHOLE
            return (f"layers.{layer}.qkv.{leaf}", _QKV[part]) if part in _QKV else None
        return (f"layers.{layer}.{_LAYER[rest]}.{leaf}", 0) if rest in _LAYER else None
    heads = {
        "bert": {"pooler.dense": "head.dense", "classifier": "head.out"},
        "roberta": {"classifier.dense": "head.dense", "classifier.out_proj": "head.out"},
    }[head]
    return (f"{heads[module]}.{leaf}", 0) if module in heads else None


def _safetensors(files: list[Path]) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    if not files:
        raise WeightLoadError("no *.safetensors files found")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                yield key, lambda f=f, key=key: f.get_tensor(key)


def load_encoder(
    model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32, ops: TorchOps | None = None
) -> EncoderModel:
    """The encoder of `model_dir` (config.json and *.safetensors, or the GGUF file it stands for); a tensor
    missing, unexpected or of another shape is a WeightLoadError naming it."""
    model_dir = Path(model_dir)
    cfg = EncoderConfig.from_dir(model_dir)
    gguf = gguf_source(model_dir)
    if gguf is not None:
        from minibatch.engine.encoders.gguf import tensors

        found = tensors(gguf)
    else:
        found = _safetensors(sorted(model_dir.glob("*.safetensors")))
    with torch.device("meta"):
        model = EncoderModel(cfg, ops)
    model = model.to_empty(device=device).to(dtype)
    params = dict(model.named_parameters())
    pending = {name: ({0, 1, 2} if ".qkv." in name else {0}) for name in params}
    unexpected: list[str] = []
    h = cfg.hidden_size
    with torch.no_grad():
        for key, read in found:
            target = _target(key, cfg.head)
            if target is None or target[0] not in params:
                if not _IGNORED.search(key) and not (model.head is None and "pooler." in key):
                    unexpected.append(key)
                continue
            name, shard = target
            dest = params[name]
            if ".qkv." in name and shard != WHOLE:
                dest = dest[shard * h : (shard + 1) * h]
            tensor = read()
            if tuple(dest.shape) != tuple(tensor.shape):
                raise WeightLoadError(f"tensor {key} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor.to(dtype))
            pending[name] -= {0, 1, 2} if shard == WHOLE else {shard}
    missing = sorted(n for n, shards in pending.items() if shards)
    if missing or unexpected:
        msg = [f"missing tensors: {', '.join(missing)}"] if missing else []
        msg += [f"unexpected tensors: {', '.join(sorted(unexpected))}"] if unexpected else []
        raise WeightLoadError("; ".join(msg))
    if gguf is not None:
        from minibatch.engine.encoders.gguf import summary

        model.weights_desc = f"{summary(gguf)} dequantised to {str(dtype).removeprefix('torch.')}"
    model.build_rotary(device)
    model = model.eval().requires_grad_(False)
    if torch.device(device).type == "cpu" and dtype == torch.float32 and packed_linear_available():
        pack_linears(model)  # oneDNN's packed layout: a row's result whatever else is in the call
    return model

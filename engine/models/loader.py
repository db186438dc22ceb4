"""Build a model and fill its parameters from safetensors files, tensor by tensor, by name."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from ..attention import AttentionBackend
from .config import ModelConfig
from .cpu_linear import PackedLinear, pack_linears, packed_linear_available
from .llama import LlamaForCausalLM
from .ops import TorchOps

# Hugging Face keeps these projections apart; we stack them: (our name, shard index).
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# Tensors some checkpoints carry that the forward recomputes or does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightLoadError(ValueError):
    """The checkpoint's tensors do not match the model's parameters."""


def load_model(
    model_dir: str | Path,
    backend: AttentionBackend,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    packed: bool = True,
    ops: TorchOps | None = None,
) -> LlamaForCausalLM:
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend, ops)
    model = model.to_empty(device=device).to(dtype)
    load_weights(model, sorted(model_dir.glob("*.safetensors")))
    model.model.rotary.build_tables(torch.device(device))
    model = model.eval().requires_grad_(False)
    if packed and torch.device(device).type == "cpu" and dtype == torch.float32 and packed_linear_available():
        out_weight = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        model.logits_proj = PackedLinear(out_weight, None)
        if model.lm_head is not None:
            model.lm_head = None  # its packed copy is all the forward uses
        pack_linears(model.model)
    return model


def _shard_bounds(model: LlamaForCausalLM, stacked: str) -> list[int]:
    cfg = model.config
    if stacked == "qkv_proj":
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [0, q, q + kv, q + 2 * kv]
    return [0, cfg.intermediate_size, 2 * cfg.intermediate_size]


def load_weights(model: LlamaForCausalLM, files: list[Path]) -> None:
    """Copy every checkpoint tensor into its parameter; name any missing or unexpected one."""
    if not files:
        raise WeightLoadError("no *.safetensors files found")
    params = dict(model.named_parameters())
    pending: dict[str, set[int]] = {}  # parameter -> shard indices still unfilled
    for name in params:
        parts = name.split(".")
        stacked = parts[-2] in ("qkv_proj", "gate_up_proj")
        pending[name] = set(range(3 if parts[-2] == "qkv_proj" else 2)) if stacked else {0}
    unexpected: list[str] = []
    with torch.no_grad():
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    if key.endswith(_IGNORED_SUFFIXES):
                        continue
                    if key == "lm_head.weight" and model.lm_head is None:
                        continue  # tied embeddings: the checkpoint may still store a copy
                    target, shard = _target(key)
                    if target not in params:
                        unexpected.append(key)
                        continue
                    _copy(model, params[target], target, shard, f.get_tensor(key), key)
                    pending[target].discard(shard)
    missing = sorted(n for n, shards in pending.items() if shards)
    if missing or unexpected:
        msg = []
        if missing:
            msg.append(f"missing tensors: {', '.join(missing)}")
        if unexpected:
            msg.append(f"unexpected tensors: {', '.join(sorted(unexpected))}")
        raise WeightLoadError("; ".join(msg))


def _target(key: str) -> tuple[str, int]:
    parts = key.split(".")
    if len(parts) >= 2 and parts[-2] in _STACKED:
        stacked, shard = _STACKED[parts[-2]]
        return ".".join(parts[:-2] + [stacked, parts[-1]]), shard
    return key, 0


def _copy(model, param: torch.Tensor, target: str, shard: int, tensor: torch.Tensor, key: str) -> None:
    stacked = target.split(".")[-2]
    if stacked in ("qkv_proj", "gate_up_proj"):
        bounds = _shard_bounds(model, stacked)
        dest = param[bounds[shard] : bounds[shard + 1]]
    else:
        dest = param
    if tuple(dest.shape) != tuple(tensor.shape):
        raise WeightLoadError(f"tensor {key} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(tensor.to(dest.dtype))

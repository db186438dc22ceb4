"""Build a model and fill its parameters, by name, from safetensors files or straight from a GGUF file.

Weight modes:
- `native`: GGUF matrices stay block-quantized and run on the C++ kernels
  (CPU only); a safetensors model stays fp32 (packed for oneDNN).
- `float32`: everything dequantised to fp32 (the reference path).
- `q8_0`: a safetensors model's matrices quantized at load, round-to-nearest
  per block of 32, then run as `native` runs a Q8_0 file.
- `auto`: `native` on CPU, `float32` elsewhere (GPUs run bf16/fp16 copies).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from minibatch.engine.attention.metadata import AttentionBackend
from minibatch.engine.core.info import WEIGHT_MODES
from minibatch.engine.models.config import ModelConfig
from minibatch.engine.models.llama import LlamaForCausalLM, RMSNorm
from minibatch.engine.models.ops import TorchOps
from minibatch.engine.store.cache import SOURCE_FILE
from minibatch.engine.weights.cpu_linear import PackedLinear, pack_linears, packed_linear_available

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
    weights: str = "auto",
) -> LlamaForCausalLM:
    """The model of `model_dir` (config.json, and safetensors or the GGUF its source file names).

    `model.weights_desc` says what runs, e.g. "Q4_1 (+Q8_0 embedding) native" or "float32".
    """
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {weights!r}")
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    on_cpu = torch.device(device).type == "cpu"
    if weights == "auto":
        weights = "native" if on_cpu and dtype == torch.float32 else "float32"
    if weights in ("native", "native-exact", "q8_0") and not (on_cpu and dtype == torch.float32):
        raise ValueError(f"--weights {weights} runs on the CPU in float32 only; use --weights float32 on {device}")
    gguf_path = gguf_source(model_dir)
    if weights == "q8_0" and gguf_path is not None:
        raise ValueError("--weights q8_0 quantizes a safetensors model; a GGUF file runs natively (--weights native)")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend, ops)
    if gguf_path is not None and weights in ("native", "native-exact"):
        from minibatch.engine.gguf.tensors import GGUFWeights
        from minibatch.engine.weights.native import install_gguf_weights

        gw = GGUFWeights(gguf_path, cfg)
        install_gguf_weights(model, gw, packed=packed, int8=weights == "native")
        model.weights_desc = f"{gw.summary()} {weights}"
    else:
        model = model.to_empty(device=device).to(dtype)
        if gguf_path is not None:
            from minibatch.engine.gguf.tensors import GGUFWeights

            gw = GGUFWeights(gguf_path, cfg)
            fill_parameters(model, ((name, t.dequantized_on(device)) for name, t in gw.tensors.items()))
            model.weights_desc = f"{gw.summary()} dequantised to {str(dtype).removeprefix('torch.')}"
        else:
            load_weights(model, sorted(model_dir.glob("*.safetensors")))
            model.weights_desc = str(dtype).removeprefix("torch.")
    if cfg.norm_plus_one and gguf_path is None:  # a GGUF holds them as 1 + w already
        # Gemma's norms scale by (1 + w): store 1 + w once, so every norm kernel runs unchanged
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, RMSNorm):
                    module.weight.add_(1.0)
    # tables for the default context (LongRoPE: its original length, short factors); use_context sizes them
    model.model.rotary.build_tables(torch.device(device), length=cfg.default_context)
    if model.model.rotary_local is not None:
        model.model.rotary_local.build_tables(torch.device(device), length=cfg.default_context)
    model = model.eval().requires_grad_(False)
    if weights == "q8_0":
        from minibatch.engine.weights.native import quantize_linears

        quantize_linears(model, "Q8_0", int8=True)
        model.weights_desc = "Q8_0 native (quantized at load)"
    elif weights == "float32" or gguf_path is None:
        if packed and on_cpu and dtype == torch.float32 and packed_linear_available():
            out_weight = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
            model.logits_proj = PackedLinear(out_weight, None)
            if model.lm_head is not None:
                model.lm_head = None  # its packed copy is all the forward uses
            pack_linears(model.model)
    return model


def runs_exactly(model_dir: str | Path, weights: str, device: str, dtype: torch.dtype) -> bool:
    """Whether load_model's forward is the reference's (no quantized matmul): native-exact, or dense weights
    (float32 mode, a safetensors model without --weights q8_0)."""
    if weights == "auto":
        weights = "native" if torch.device(device).type == "cpu" and dtype == torch.float32 else "float32"
    if weights == "native":
        return gguf_source(Path(model_dir)) is None
    return weights in ("native-exact", "float32")


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file whose weights `model_dir` stands for, or None for a safetensors directory."""
    marker = Path(model_dir) / SOURCE_FILE
    if not marker.is_file():
        return None
    info = json.loads(marker.read_text())
    if not info.get("weights_from_gguf"):
        return None
    source = info.get("gguf")
    if not source or not Path(source).is_file():
        raise WeightLoadError(f"{model_dir} stands for the GGUF file {source}, which no longer exists")
    return Path(source)


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

    def tensors():
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)

    fill_parameters(model, tensors())


def fill_parameters(model: LlamaForCausalLM, tensors) -> None:
    """Copy (Hugging Face name, tensor) pairs into the model's (stacked) parameters."""
    params = dict(model.named_parameters())
    pending: dict[str, set[int]] = {}  # parameter -> shard indices still unfilled
    for name in params:
        parts = name.split(".")
        stacked = parts[-2] in ("qkv_proj", "gate_up_proj")
        pending[name] = set(range(3 if parts[-2] == "qkv_proj" else 2)) if stacked else {0}
    unexpected: list[str] = []
    with torch.no_grad():
        for key, tensor in tensors:
            if key.endswith(_IGNORED_SUFFIXES):
                continue
            key = text_model_key(key)
            if key is None:  # a vision model's tower and projector: engine/vision/ loads them
                continue
            if key == "lm_head.weight" and model.lm_head is None:
                continue  # tied embeddings: the checkpoint may still store a copy
            target, shard = _target(key)
            if target not in params:
                unexpected.append(key)
                continue
            if shard is None:  # stored fused (Phi-3's qkv_proj, gate_up_proj): split into our shards
                bounds = _shard_bounds(model, target.split(".")[-2])
                if tensor.shape[0] != bounds[-1]:
                    raise WeightLoadError(f"tensor {key} has {tensor.shape[0]} rows, expected {bounds[-1]}")
                for i in range(len(bounds) - 1):
                    _copy(model, params[target], target, i, tensor[bounds[i] : bounds[i + 1]], key)
                    pending[target].discard(i)
                continue
            _copy(model, params[target], target, shard, tensor, key)
            pending[target].discard(shard)
    missing = sorted(n for n, shards in pending.items() if shards)
    if missing or unexpected:
        msg = []
        if missing:
            msg.append(f"missing tensors: {', '.join(missing)}")
        if unexpected:
            msg.append(f"unexpected tensors: {', '.join(sorted(unexpected))}")
        raise WeightLoadError("; ".join(msg))


_VISION_PARTS = ("vision_tower.", "multi_modal_projector.", "vision_model.", "connector.")


def text_model_key(key: str) -> str | None:
    """A vision model's text tensors under a text model's names (Gemma 3's: transformers 5's
    `model.language_model.*`, the hub's `language_model.model.*` and `language_model.lm_head.*`; Idefics3's
    `model.text_model.*`); None for its vision tensors; any other name as it is."""
    if key.removeprefix("model.").startswith(_VISION_PARTS):
        return None
    for wrapped in ("model.language_model.", "model.text_model."):
        if key.startswith(wrapped):
            return "model." + key.removeprefix(wrapped)
    if key.startswith("language_model."):
        return key.removeprefix("language_model.")
    return key


def _target(key: str) -> tuple[str, int | None]:
    """(our parameter, which shard of it); shard None for a checkpoint tensor that is already fused."""
    parts = key.split(".")
    if len(parts) >= 2 and parts[-2] in _STACKED:
        stacked, shard = _STACKED[parts[-2]]
        return ".".join(parts[:-2] + [stacked, parts[-1]]), shard
    if len(parts) >= 2 and parts[-2] in ("qkv_proj", "gate_up_proj"):
        return key, None
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

"""The model hyper-parameters our forward needs, read from a Hugging Face config.json."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
# Families people ask for that our forward does not run yet, and what they need.
_NOT_YET = {
    "gemma": "scaled embeddings, (1 + w) norms and GeGLU",
    "gemma2": "pre- and post-norms, logit soft-capping and alternating sliding-window layers",
    "gemma3": "pre- and post-norms, two rope bases and alternating sliding-window layers",
    "gemma3_text": "pre- and post-norms, two rope bases and alternating sliding-window layers",
}


class UnsupportedModelError(ValueError):
    """The config describes a model our forward cannot run."""


@dataclass(slots=True, frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # "default" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    short_factor: tuple[float, ...] = ()  # LongRoPE: per-frequency divisors below the original length
    attention_factor: float = 1.0  # LongRoPE: cos and sin are scaled by it


@dataclass(slots=True, frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...] = field(default=())
    bos_token_id: int | None = None
    sliding_window: int | None = None  # attend to the last this-many positions only (Mistral), every layer
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary (Qwen3)

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        model_type = cfg.get("model_type", "")
        if model_type in _NOT_YET:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported yet (it needs {_NOT_YET[model_type]}); "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // num_heads
        # Qwen2 always has q/k/v bias and no o_proj bias; Llama's attention_bias
        # covers all four projections.
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        window = cfg.get("sliding_window") if model_type in ("mistral", "phi3") else None
        partial = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            raise UnsupportedModelError(f"partial_rotary_factor {partial} (rotary on part of each head) is not supported")
        if model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
            # Qwen's windows apply to layers past max_window_layers only: a per-layer window we do not run.
            raise UnsupportedModelError("use_sliding_window (Qwen's per-layer sliding windows) is not supported")
        max_position = cfg.get("max_position_embeddings", 2048)
        rope = _rope_from_dict(cfg)
        if rope.rope_type == "longrope":
            # Past the original length LongRoPE switches every position to its long factors, which would
            # invalidate the cached keys; we run the short factors and stop the context there.
            max_position = min(max_position, rope.original_max_position)
        if window is not None and (not isinstance(window, int) or window < 1):
            raise UnsupportedModelError(f"sliding_window must be a positive integer or null, got {window!r}")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position=max_position,
            rope=rope,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            sliding_window=window if window is not None and window < max_position else None,
            qk_norm=model_type == "qwen3",
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        return cls.from_dict(json.loads(path.read_text()))


def _rope_from_dict(cfg: dict) -> RopeConfig:
    # transformers 5 keeps theta and scaling in `rope_parameters`; older
    # configs have `rope_theta` and `rope_scaling` at the top level.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    if rope_type in ("longrope", "su"):
        original = int(merged.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
                       or cfg.get("max_position_embeddings", 2048))
        factor = merged.get("factor") or cfg.get("max_position_embeddings", original) / original
        attention = merged.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return RopeConfig(theta=float(theta), rope_type="longrope", original_max_position=original,
                          short_factor=tuple(float(f) for f in merged["short_factor"]), attention_factor=float(attention))
    if rope_type != "llama3":
        raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported (default, llama3, longrope)")
    return RopeConfig(
        theta=float(theta),
        rope_type="llama3",
        factor=float(merged["factor"]),
        low_freq_factor=float(merged["low_freq_factor"]),
        high_freq_factor=float(merged["high_freq_factor"]),
        original_max_position=int(merged["original_max_position_embeddings"]),
    )

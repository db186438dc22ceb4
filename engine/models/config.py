"""The model hyper-parameters our forward needs, read from a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from minibatch.engine.core.request import POOLINGS

# a vision model's folder type -> its text model's (config.json's `text_config`; the tower is engine/vision/'s)
VISION_WRAPPERS = {"gemma3": "gemma3_text", "idefics3": "llama", "smolvlm": "llama"}
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
GEMMA = ("gemma2", "gemma3_text")
# Families people ask for that our forward does not run yet, and what they need.
_NOT_YET = {
    "gemma": "Gemma 1's layout (no pre/post norms); Gemma 2 and 3 run",
}


class UnsupportedModelError(ValueError):
    """The config describes a model our forward cannot run."""


class ModelSettingError(ValueError):
    """A setting this model cannot take (a KV cache type its heads cannot hold, say): its text names the
    option and what would do, never a server path, so the daemon shows it to the request that loaded it."""


@dataclass(slots=True, frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # "default" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    short_factor: tuple[float, ...] = ()  # LongRoPE: per-frequency divisors up to the original length
    long_factor: tuple[float, ...] = ()  # LongRoPE: the divisors for a context past it (every position then)
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
    max_position: int  # the model's context length (LongRoPE: its long one; default_context says what runs)
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...] = field(default=())
    bos_token_id: int | None = None
    sliding_window: int | None = None  # attend to the last this-many positions only (Mistral), every layer
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary (Qwen3)
    # Gemma 2 / 3
    hidden_act: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: float | None = None  # embeddings multiplied by sqrt(hidden_size)
    norm_plus_one: bool = False  # RMSNorm scales by (1 + w); stored as (1 + w) at load
    sandwich_norms: bool = False  # norms after attention and around the MLP (pre_/post_feedforward_layernorm)
    query_scale: float | None = None  # attention scale other than head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    layer_windows: tuple[int, ...] = ()  # per layer: its sliding window, 0 for global attention (empty: every layer
    #                                      uses sliding_window)
    rope_local: RopeConfig | None = None  # the rotary of the sliding layers when it differs (Gemma 3)
    # how an embedding pools the prompt's hidden states: the model's own (a GGUF's pooling_type), else the last
    # token's, as the decoder-based embedding models (Qwen3-Embedding, gte-Qwen2, e5-mistral) pool
    pooling: str = "last"
    # "rank" (a decoder reranker, Qwen3-Reranker's GGUF): its last token's hidden state scored by `score` rows
    # (llama.cpp's cls.output: the lm_head's "yes" and "no" rows), the relevance the first row's softmax share
    score_labels: int = 0
    # a vision model's text side (Gemma 3's folder): the token whose run in a prompt an image's embeddings take
    # the place of (engine/vision/ makes them), None for a model that sees no images
    image_token_id: int | None = None
    image_bounds: tuple[int, int] | None = None  # the tokens before and after an image's run (Gemma 3's boi, eoi)

    @property
    def default_context(self) -> int:
        """The context a server runs without being told: the model's, except LongRoPE's original length
        (past it every position rotates with the long factors; see LlamaForCausalLM.use_context)."""
        if self.rope.rope_type == "longrope":
            return min(self.max_position, self.rope.original_max_position)
        return self.max_position

    @property
    def release_window(self) -> int:
        """The window past which KV blocks can be handed back: the widest one when every layer has a window
        (Mistral, Phi-3 mini), 0 when any layer attends to everything (Gemma's global layers) or none has one."""
        windows = [self.window_of(layer) for layer in range(self.num_layers)]
        return max(windows) if windows and min(windows) > 0 else 0

    def window_of(self, layer: int) -> int:
        if self.layer_windows:
            return self.layer_windows[layer]
        return self.sliding_window or 0

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        model_type = cfg.get("model_type", "")
        if model_type in VISION_WRAPPERS and isinstance(cfg.get("text_config"), dict):
            # a vision model's folder: its text model's config, with what marks an image in a prompt
            text = {**cfg["text_config"], "model_type": VISION_WRAPPERS[model_type]}
            image = cfg.get("image_token_id", cfg.get("image_token_index"))
            bounds = cfg.get("boi_token_index"), cfg.get("eoi_token_index")
            return dataclasses.replace(
                cls.from_dict(text),
                image_token_id=None if image is None else int(image),
                image_bounds=None if None in bounds else (int(bounds[0]), int(bounds[1])),
            )
        if model_type in _NOT_YET:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported yet (it needs {_NOT_YET[model_type]}); "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type in GEMMA:
            return _gemma(cfg)
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
            raise UnsupportedModelError(
                f"partial_rotary_factor {partial} (rotary on part of each head) is not supported"
            )
        if model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
            # Qwen's windows apply to layers past max_window_layers only: a per-layer window we do not run.
            raise UnsupportedModelError("use_sliding_window (Qwen's per-layer sliding windows) is not supported")
        max_position = cfg.get("max_position_embeddings", 2048)
        rope = _rope_from_dict(cfg)
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
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        cfg = json.loads(path.read_text())
        config = cls.from_dict(cfg)
        pooling = cfg.get("pooling")
        if pooling is None:
            return config
        if pooling not in POOLINGS:
            raise UnsupportedModelError(f"pooling {pooling!r} is not supported ({', '.join(POOLINGS)})")
        labels = int(cfg.get("num_labels", 0)) if pooling == "rank" else 0
        if pooling == "rank" and labels not in (1, 2):
            raise UnsupportedModelError(f"pooling rank with {labels} score rows is not supported (1 or 2)")
        return dataclasses.replace(config, pooling=pooling, score_labels=labels)


def _gemma(cfg: dict) -> ModelConfig:
    """Gemma 2 and Gemma 3 (text): GeGLU, scaled embeddings, (1 + w) norms around attention and the MLP,
    sliding-window layers alternating with global ones; Gemma 2 soft-caps scores and logits, Gemma 3
    normalises q and k and gives its sliding layers their own rope base."""
    model_type = cfg["model_type"]
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    layers = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if not types:  # older configs: Gemma 2 alternates from a sliding first layer, Gemma 3 has one global in six
        every = cfg.get("sliding_window_pattern") or (2 if model_type == "gemma2" else 6)
        types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)]
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(f"layer_types {types!r} is not one of sliding_attention / full_attention per layer")
    windows = tuple(int(window) if t == "sliding_attention" and window else 0 for t in types)
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5: rope per layer type
        full = _rope_from_dict({**cfg, "rope_parameters": params.get("full_attention") or {}})
        local = _rope_from_dict({**cfg, "rope_parameters": params.get("sliding_attention") or {}})
    else:
        full = _rope_from_dict(cfg)
        base = cfg.get("rope_local_base_freq")
        local = RopeConfig(theta=float(base)) if base is not None and model_type == "gemma3_text" else full
    eos = cfg.get("eos_token_id")
    return ModelConfig(
        model_type=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position=cfg.get("max_position_embeddings", 8192),
        rope=full,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=False,
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        bos_token_id=cfg.get("bos_token_id"),
        sliding_window=None,
        qk_norm=model_type == "gemma3_text",
        hidden_act="gelu_tanh",
        embed_scale=hidden**0.5,
        norm_plus_one=True,
        sandwich_norms=True,
        query_scale=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        attn_softcap=cfg.get("attn_logit_softcapping"),
        final_softcap=cfg.get("final_logit_softcapping"),
        layer_windows=windows,
        rope_local=local if local != full else None,
    )


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
        original = int(
            merged.get("original_max_position_embeddings")
            or cfg.get("original_max_position_embeddings")
            or cfg.get("max_position_embeddings", 2048)
        )
        factor = merged.get("factor") or cfg.get("max_position_embeddings", original) / original
        attention = merged.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return RopeConfig(
            theta=float(theta),
            rope_type="longrope",
            original_max_position=original,
            short_factor=tuple(float(f) for f in merged["short_factor"]),
            long_factor=tuple(float(f) for f in merged.get("long_factor") or merged["short_factor"]),
            attention_factor=float(attention),
        )
    if rope_type == "linear":
        return RopeConfig(theta=float(theta), rope_type="linear", factor=float(merged["factor"]))
    if rope_type != "llama3":
        raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported (default, linear, llama3, longrope)")
    return RopeConfig(
        theta=float(theta),
        rope_type="llama3",
        factor=float(merged["factor"]),
        low_freq_factor=float(merged["low_freq_factor"]),
        high_freq_factor=float(merged["high_freq_factor"]),
        original_max_position=int(merged["original_max_position_embeddings"]),
    )

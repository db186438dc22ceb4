"""A GGUF's config and tokenizer as Hugging Face files, read from its metadata by our own reader.

A GGUF carries the model's hyper-parameters under llama.cpp's key names (values it leaves out take
llama.cpp's default for the architecture, which the file was made for), Phi-3's LongRoPE factors as tensors,
and its tokenizer as arrays (gguf/vocab.py turns those into a tokenizer.json). This writes what a model
directory holds -- config.json, generation_config.json, tokenizer.json, tokenizer_config.json,
chat_template.jinja -- in well under a second, where transformers' GGUF reader takes ~11 s for the
built-in model (it materialises every metadata value first).

Covered: the architectures our forward runs (ARCHITECTURES) with a byte-level BPE or SentencePiece
vocabulary, and encoders (`bert`, with WordPiece or Unigram vocabularies: engine/encoders/gguf.py).
Anything else (can_prepare says what) is read by transformers' GGUF reader instead: write_config_and_tokenizer
chooses.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from minibatch.engine.encoders import gguf as encoder_files
from minibatch.engine.gguf.architectures import ARCHITECTURES
from minibatch.engine.gguf.vocab import NAMED, can_write, write_tokenizer

if TYPE_CHECKING:
    from minibatch.engine.gguf.reader import GGUFFile

_HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
# Tokens llama.cpp ends generation on by their text, whatever the metadata says (its end-of-generation set).
END_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>")
# Default sampling a GGUF may carry (general.sampling.*) -> generation_config.json's names.
_SAMPLING = {
    "temp": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "penalty_repeat": "repetition_penalty",
    "xtc_probability": "xtc_probability",
    "xtc_threshold": "xtc_threshold",
    "mirostat": "mirostat",
    "mirostat_tau": "mirostat_tau",
    "mirostat_eta": "mirostat_eta",
}


# {arch}.pooling_type -> how an embedding pools the hidden states (llama.cpp's enum: 0 none; 4 rank: a decoder
# reranker's last token scored by its cls.output rows)
POOLING_TYPES = {1: "mean", 2: "cls", 3: "last", 4: "rank"}


def can_prepare(gguf: GGUFFile) -> str | None:
    """None when write_model_files can do this file, else why not."""
    if gguf.architecture in encoder_files.ARCHITECTURES:  # an encoder (BERT, NomicBERT): engine/encoders/gguf.py
        return encoder_files.can_prepare(gguf)
    if gguf.architecture not in ARCHITECTURES:
        return f"architecture {gguf.architecture!r}"
    return can_write(gguf.metadata)


def write_model_files(gguf: GGUFFile, out: Path) -> None:
    """config.json, generation_config.json and the tokenizer files for `gguf` (can_prepare must be None)."""
    if gguf.architecture in encoder_files.ARCHITECTURES:
        encoder_files.write_model_files(gguf, out)
        return
    tokens = gguf.array("tokenizer.ggml.tokens")
    config = model_config(gguf, len(tokens))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    meta = gguf.metadata
    eos = [config["eos_token_id"]] if config.get("eos_token_id") is not None else []
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):  # end of turn / of message
        if isinstance(meta.get(key), int) and meta[key] not in eos:
            eos.append(meta[key])
    eos += [i for i, t in enumerate(tokens) if t in END_TOKENS and i not in eos]
    generation = {k: config[k] for k in ("bos_token_id", "pad_token_id") if config.get(k) is not None}
    if eos:
        generation["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    for key, name in _SAMPLING.items():
        value = meta.get(f"general.sampling.{key}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            generation[name] = value
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    write_tokenizer(gguf, tokens, out)


def model_config(gguf: GGUFFile, n_tokens: int) -> dict:
    """A transformers-style config.json for the architecture, from `{arch}.*` metadata.

    Where a file leaves a value out, llama.cpp's default for the architecture is taken (the file was made for
    it): Gemma's layer pattern and local rope base, Gemma 2's caps, the 27B models' query scale, Phi-3's window.
    """
    meta, arch = gguf.metadata, gguf.architecture

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    heads, hidden, layers = get("attention.head_count"), get("embedding_length"), get("block_count")
    names = {t.name for t in gguf.tensors}
    config = {
        "model_type": "gemma3_text" if arch == "gemma3" else arch,
        "architectures": [_HF_CLASSES[arch]],
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length") or get("rope.dimension_count") or hidden // heads,
        "rms_norm_eps": _decimal(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": get("context_length", 2048),
        "rope_parameters": {"rope_type": "default", "rope_theta": _decimal(get("rope.freq_base", 10000.0))},
        "vocab_size": get("vocab_size", n_tokens),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": False,
    }
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):  # our forward refuses what it cannot run, by name
        config["rope_parameters"].update(rope_type=scaling, factor=_decimal(get("rope.scaling.factor")))
    if get("attention.sliding_window"):
        config["sliding_window"] = get("attention.sliding_window")
    pooling = POOLING_TYPES.get(get("pooling_type"))
    if pooling == "rank":  # Qwen3-Reranker: the rows that score the last token
        scores = next((t for t in gguf.tensors if t.name == "cls.output.weight"), None)
        config["num_labels"] = int(scores.dims[1]) if scores is not None and len(scores.dims) == 2 else 0
    if pooling is not None:  # an embedding model's (Qwen3-Embedding: last); none said: the engine's default
        config["pooling"] = pooling
    freqs = next((t for t in gguf.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:  # Llama 3.1+: the converter stores the rope scaling as per-frequency factors
        _llama3_rope(gguf, config, _f32_tensor(gguf, freqs))
    if arch in ("gemma2", "gemma3"):
        _gemma_config(gguf, config)
    elif arch == "phi3":
        _phi3_config(gguf, config)
    for name, key in NAMED.items():
        value = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(value, int):
            config[name.replace("_token", "_token_id")] = value
    if isinstance(meta.get("general.name"), str):
        config["_name_or_path"] = meta["general.name"]
    return config


def _gemma_config(gguf: GGUFFile, config: dict) -> None:
    meta, arch = gguf.metadata, gguf.architecture
    layers, hidden, heads = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    config["hidden_activation"] = config["hidden_act"] = "gelu_pytorch_tanh"
    config["head_dim"] = meta.get(f"{arch}.attention.key_length", 256)
    config["sliding_window"] = meta.get(f"{arch}.attention.sliding_window", 4096)
    pattern = gguf.array(f"{arch}.attention.sliding_window_pattern")  # newer files: sliding or not, per layer
    if pattern is not None and len(pattern) == layers:
        sliding = [bool(p) for p in pattern]
    else:
        every = meta.get(f"{arch}.attention.sliding_window_pattern")
        every = every if isinstance(every, int) and every > 0 else (2 if arch == "gemma2" else 6)
        sliding = [i % every < every - 1 for i in range(layers)]
    config["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    # llama.cpp scales queries by 1/sqrt(head_dim), except the 27B models: 1/sqrt(hidden / heads)
    big = layers == (46 if arch == "gemma2" else 62)
    config["query_pre_attn_scalar"] = hidden // heads if big else config["head_dim"]
    if arch == "gemma2":
        config["attn_logit_softcapping"] = _decimal(meta.get("gemma2.attn_logit_softcapping", 50.0))
        config["final_logit_softcapping"] = _decimal(meta.get("gemma2.final_logit_softcapping", 30.0))
    else:  # the local layers rotate with base 10000, unscaled; the file's base and scaling are the global layers'
        config["rope_local_base_freq"] = 10000.0


def _phi3_config(gguf: GGUFFile, config: dict) -> None:
    meta = gguf.metadata
    layers, context = config["num_hidden_layers"], config["max_position_embeddings"]
    window = meta.get("phi3.attention.sliding_window")
    if window is None and layers in (32, 40) and context == 4096:  # older Phi-3 mini/medium 4k files
        window = 2047
    config["sliding_window"] = window or None  # 0: no window (Phi-4)
    factors = {info.name: info for info in gguf.tensors if info.name.startswith("rope_factors_")}
    if factors:  # LongRoPE (the 128k models): per-frequency divisors stored as tensors
        config["rope_parameters"].update(
            rope_type="longrope",
            short_factor=_f32_tensor(gguf, factors["rope_factors_short.weight"]),
            long_factor=_f32_tensor(gguf, factors["rope_factors_long.weight"]),
            original_max_position_embeddings=meta.get("phi3.rope.scaling.original_context_length", context),
        )
        if isinstance(meta.get("phi3.rope.scaling.attn_factor"), float):
            config["rope_parameters"]["attention_factor"] = _decimal(meta["phi3.rope.scaling.attn_factor"])


# Meta's Llama 3.1-3.3 scaling: factor 1 above these wavelengths' frequencies, `factor` below, smooth between.
LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR = 1.0, 4.0


def llama3_factors(theta: float, dim: int, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """The per-frequency divisors Llama 3's rope scaling applies (what llama.cpp's converter writes as
    rope_freqs.weight, and what our forward computes from the same four numbers)."""
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * np.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    between = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, between))


def _llama3_rope(gguf: GGUFFile, config: dict, factors: list[float]) -> None:
    """rope_parameters from a rope_freqs tensor: Llama 3's scaling, its four numbers recovered from the factors
    (factor = the largest; the original context from the smooth band, Meta's low/high frequency factors) and
    checked by recomputing every factor. Factors that are not that scaling are refused, not ignored."""
    from minibatch.engine.models.config import UnsupportedModelError

    f = np.asarray(factors, dtype=np.float64)
    theta, dim = config["rope_parameters"]["rope_theta"], 2 * len(f)
    if np.all(f == 1.0):
        return
    factor, low, high = float(f.max()), LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR
    wavelen = 2 * np.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    band = (f > 1.0) & (f < factor)
    if band.any():  # 1/f = (1 - s)/factor + s, s = (original / wavelen - low) / (high - low)
        s = (1 / f[band] - 1 / factor) / (1 - 1 / factor)
        original = int(round(float(np.median(wavelen[band] * (s * (high - low) + low)))))
    else:  # no frequency in the band: the largest context whose band holds none
        original = int(np.floor(wavelen[f < factor].max() * high)) if (f < factor).any() else 8192
    want = llama3_factors(theta, dim, factor, low, high, original)
    if want.shape != f.shape or not np.allclose(want, f, rtol=1e-5, atol=0):
        raise UnsupportedModelError(
            f"{gguf.path}: rope_freqs.weight is not Llama 3's rope scaling (best fit: factor {factor:g}, "
            f"original context {original}, off by {np.abs(want - f).max():.3g}); the forward cannot run it"
        )
    config["rope_parameters"].update(
        rope_type="llama3",
        factor=_decimal(factor),
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=original,
    )


def _f32_tensor(gguf: GGUFFile, info) -> list[float]:
    if info.ggml_type != 0:  # F32
        raise ValueError(f"{gguf.path}: {info.name} is not stored as F32 (type {info.ggml_type})")
    count = int(np.prod(info.dims))
    return [_decimal(x) for x in gguf.data(info, 4 * count).view(np.float32)]


def _decimal(value):
    """A float32 from the file as the shortest decimal that reads back as the same float32 (1e-06, not
    9.99999997e-07): the value the model's own config says."""
    return value if value is None else float(str(np.float32(value)))


def write_config_and_tokenizer(gguf: Path, out: Path) -> str:
    """config.json, generation_config.json and the tokenizer files from the GGUF metadata; returns whose reader.

    Our reader (this module) covers byte-level BPE vocabularies of the families we run, in well under a
    second; anything else is read by transformers' GGUF reader (seconds to tens of seconds).
    """
    from minibatch.engine.gguf.reader import GGUFFile

    f = GGUFFile(gguf)
    why_not = can_prepare(f)
    if why_not is None:
        write_model_files(f, out)
        return "minibatch"
    print(
        f"minibatch: reading {gguf.name}'s config and tokenizer with transformers, once ({why_not} is not covered "
        "by our reader)",
        file=sys.stderr,
    )
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return "transformers"

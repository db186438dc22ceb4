"""A GGUF's config and tokenizer as Hugging Face files, read from its metadata by our own reader.

A GGUF carries the model's hyper-parameters under llama.cpp's key names and its tokenizer as arrays
(tokens, merges, token types) plus the name of the pre-tokenizer llama.cpp applies. This writes what a
model directory holds -- config.json, generation_config.json, tokenizer.json, tokenizer_config.json,
chat_template.jinja -- in well under a second, where transformers' GGUF reader takes ~11 s for the
built-in model (it materialises every metadata value first).

Covered: the architectures our forward runs, with a byte-level BPE vocabulary (`tokenizer.ggml.model`
"gpt2": SmolLM, Llama 3, Qwen, Mistral's Tekken) whose pre-tokenizer is one of PRE_TOKENIZERS.
Anything else (can_prepare says what) is read by transformers' GGUF reader instead:
write_config_and_tokenizer chooses.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .weights.gguf_reader import GGUFFile

# The text splits llama.cpp names in tokenizer.ggml.pre, as the original tokenizer.json files spell them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# name -> (regex split before the byte-level step or None for GPT-2's own, digits one by one,
#          NFC-normalise first, a word in the vocabulary is taken whole before any merge)
PRE_TOKENIZERS = {
    "gpt-2": (None, False, False, False),
    "smollm": (None, True, False, False),
    "llama-bpe": (_LLAMA3_SPLIT, False, False, True),
    "llama3": (_LLAMA3_SPLIT, False, False, True),
    "qwen2": (_QWEN2_SPLIT, False, True, False),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False, True, False),
}
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types
_NAMED = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
          "pad_token": "padding_token_id"}


def can_prepare(gguf: GGUFFile) -> str | None:
    """None when write_model_files can do this file, else why not."""
    meta = gguf.metadata
    if gguf.architecture not in ARCHITECTURES:
        return f"architecture {gguf.architecture!r}"
    if meta.get("tokenizer.ggml.model") != "gpt2":
        return f"tokenizer model {meta.get('tokenizer.ggml.model')!r} (only byte-level BPE)"
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        return f"pre-tokenizer {pre!r}"
    return None


def write_model_files(gguf: GGUFFile, out: Path) -> None:
    """config.json, generation_config.json and the tokenizer files for `gguf` (can_prepare must be None)."""
    tokens = gguf.array("tokenizer.ggml.tokens")
    config = model_config(gguf, len(tokens))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    meta = gguf.metadata
    eos = [config["eos_token_id"]] if config.get("eos_token_id") is not None else []
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):  # end of turn / of message
        if isinstance(meta.get(key), int) and meta[key] not in eos:
            eos.append(meta[key])
    generation = {k: config[k] for k in ("bos_token_id", "pad_token_id") if config.get(k) is not None}
    if eos:
        generation["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    write_tokenizer(gguf, tokens, out)


def model_config(gguf: GGUFFile, n_tokens: int) -> dict:
    """A transformers-style config.json for the architecture, from `{arch}.*` metadata."""
    meta, arch = gguf.metadata, gguf.architecture

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    heads, hidden = get("attention.head_count"), get("embedding_length")
    names = {t.name for t in gguf.tensors}
    config = {
        "model_type": arch,
        "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM"}[arch]],
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length") or get("rope.dimension_count") or hidden // heads,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": get("context_length", 2048),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))},
        "vocab_size": get("vocab_size", n_tokens),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": False,
    }
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):  # our forward refuses what it cannot run, by name
        config["rope_parameters"].update(rope_type=scaling, factor=get("rope.scaling.factor"))
    if get("attention.sliding_window"):
        config["sliding_window"] = get("attention.sliding_window")
    for name, key in _NAMED.items():
        value = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(value, int):
            config[name.replace("_token", "_token_id")] = value
    if isinstance(meta.get("general.name"), str):
        config["_name_or_path"] = meta["general.name"]
    return config


def write_tokenizer(gguf: GGUFFile, tokens: list[str], out: Path) -> None:
    """tokenizer.json (byte-level BPE), tokenizer_config.json and chat_template.jinja."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    meta = gguf.metadata
    split, digits, nfc, ignore_merges = PRE_TOKENIZERS[meta.get("tokenizer.ggml.pre", "gpt-2")]
    alphabet = _bytes_to_unicode()
    letters = set(alphabet.values())
    # A token outside the byte alphabet is stored as raw text: spell it in the alphabet as the BPE sees it.
    spelled = [t if letters.issuperset(t) else "".join(alphabet[b] for b in t.encode()) for t in tokens]
    merges = gguf.array("tokenizer.ggml.merges") or []
    tok = Tokenizer(models.BPE(
        {t: i for i, t in enumerate(spelled)}, [tuple(m.split(" ", 1)) for m in merges],
        fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges,
    ))
    if nfc:
        tok.normalizer = normalizers.NFC()
    steps = []
    if split is not None:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
    if digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None))
    tok.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()

    types = gguf.array("tokenizer.ggml.token_type")
    types = list(types) if types is not None else [0] * len(tokens)
    named = {name: tokens[meta[f"tokenizer.ggml.{key}"]] for name, key in _NAMED.items()
             if isinstance(meta.get(f"tokenizer.ggml.{key}"), int) and meta[f"tokenizer.ggml.{key}"] < len(tokens)}
    # Control tokens (and the named ones) stay whole and are skipped when decoding without special tokens;
    # user-defined ones (like <think>) stay whole and are ordinary text. A "control" token spelled outside
    # the byte alphabet is a mislabel in some files; adding it would grow the vocabulary, so it is left.
    special = [t for t, k in zip(tokens, types) if k == _CONTROL and letters.issuperset(t)]
    special += [t for t in named.values() if t not in special]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED])

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and "bos_token" in named
    if add_bos:
        bos = named["bos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, meta["tokenizer.ggml.bos_token_id"])])
    tok.save(str(out / "tokenizer.json"))

    config = {"tokenizer_class": "TokenizersBackend", "add_bos_token": add_bos, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, **named}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        (out / "chat_template.jinja").write_text(template)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the rest map to code points from 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def write_config_and_tokenizer(gguf: Path, out: Path) -> str:
    """config.json, generation_config.json and the tokenizer files from the GGUF metadata; returns whose reader.

    Our reader (this module) covers byte-level BPE vocabularies of the families we run, in well under a
    second; anything else is read by transformers' GGUF reader (seconds to tens of seconds).
    """
    from .weights.gguf_reader import GGUFFile

    f = GGUFFile(gguf)
    why_not = can_prepare(f)
    if why_not is None:
        write_model_files(f, out)
        return "minibatch"
    print(f"minibatch: reading {gguf.name}'s config and tokenizer with transformers, once ({why_not} is not covered "
          "by our reader)", file=sys.stderr)
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return "transformers"

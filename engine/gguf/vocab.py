"""A GGUF's vocabulary as a `tokenizers` tokenizer.json that splits text as llama.cpp does.

Two kinds of vocabulary are covered, by `tokenizer.ggml.model`:

- "gpt2": byte-level BPE (SmolLM, Llama 3, Qwen, Mistral's Tekken). The merges are in the file; the text is
  first split by the rule named in `tokenizer.ggml.pre` (PRE_TOKENIZERS).
- "llama": SentencePiece BPE with byte fallback (Llama 2, Mistral v0.1-0.3, Phi-3, Gemma). The file has no
  merges, only a score per piece: llama.cpp joins the adjacent pair whose joined piece scores highest, so
  every split of a piece into two pieces becomes a merge ranked by the joined piece's score. Spaces are
  written as "▁", and a "▁" starts every stretch of text between special tokens unless
  `tokenizer.ggml.add_space_prefix` is false (Gemma), as llama.cpp does.

Control tokens (and the named ones) stay whole and are skipped when decoding without special tokens;
user-defined ones (like <think>) stay whole and decode as text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from minibatch.engine.text.fim import FIM_CONFIG_KEY, GGUF_KEYS
from minibatch.engine.text.tokenizer import RERANK_TEMPLATE_KEY

if TYPE_CHECKING:
    from minibatch.engine.gguf.reader import GGUFFile

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
# llama.cpp's token types
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
NAMED = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}
_SPACE = "\u2581"  # SentencePiece's "▁"


def can_write(meta: dict) -> str | None:
    """None when write_tokenizer covers this vocabulary, else what it does not cover."""
    model = meta.get("tokenizer.ggml.model")
    if model == "llama":
        return None
    if model != "gpt2":
        return f"tokenizer model {model!r} (byte-level BPE and SentencePiece BPE are)"
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        return f"pre-tokenizer {pre!r}"
    return None


def write_tokenizer(gguf: GGUFFile, tokens: list[str], out: Path) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja for the file's vocabulary (can_write is None)."""
    from tokenizers import AddedToken, processors

    meta = gguf.metadata
    types = gguf.array("tokenizer.ggml.token_type")
    types = [int(t) for t in types] if types is not None else [_NORMAL] * len(tokens)
    if meta.get("tokenizer.ggml.model") == "llama":
        tok, whole = _sentencepiece(gguf, tokens, types)
    else:
        tok, whole = _byte_level(gguf, tokens)
    named = {
        name: tokens[meta[f"tokenizer.ggml.{key}"]]
        for name, key in NAMED.items()
        if isinstance(meta.get(f"tokenizer.ggml.{key}"), int) and meta[f"tokenizer.ggml.{key}"] < len(tokens)
    }
    special = [t for t, k in zip(tokens, types) if k == _CONTROL and whole(t)]
    special += [t for t in named.values() if t not in special]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    )

    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama"))
    add_bos = add_bos and "bos_token" in named
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and "eos_token" in named
    if add_bos or add_eos:
        added = [
            (name, meta[f"tokenizer.ggml.{name}_token_id"]) for name, on in (("bos", add_bos), ("eos", add_eos)) if on
        ]
        bos, eos = named.get("bos_token"), named.get("eos_token")

        def around(text: str, seq: int) -> str:  # one sequence with the BOS before it and the EOS after it
            return " ".join([f"{bos}:{seq}"] * add_bos + [f"{text}:{seq}"] + [f"{eos}:{seq}"] * add_eos)

        tok.post_processor = processors.TemplateProcessing(
            single=around("$A", 0),
            pair=f"{around('$A', 0)} {around('$B', 1)}",
            special_tokens=[(named[f"{name}_token"], token_id) for name, token_id in added],
        )
    tok.save(str(out / "tokenizer.json"))

    config = {
        "tokenizer_class": "TokenizersBackend",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        **named,
    }
    fim = {field: meta.get(f"tokenizer.ggml.fim_{key}_token_id") for field, key in GGUF_KEYS.items()}
    fim = {field: i for field, i in fim.items() if isinstance(i, int) and 0 <= i < len(tokens)}
    if {"prefix", "suffix", "middle"} <= fim.keys():  # the file names its fill-in-the-middle markers
        config[FIM_CONFIG_KEY] = fim
    rerank = meta.get("tokenizer.chat_template.rerank")
    if isinstance(rerank, str) and rerank:  # a decoder reranker's prompt (Qwen3-Reranker's, as converted)
        config[RERANK_TEMPLATE_KEY] = rerank
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        (out / "chat_template.jinja").write_text(template)


def _byte_level(gguf: GGUFFile, tokens: list[str]):
    """Byte-level BPE with the file's merges; returns it and which tokens can be added whole."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    split, digits, nfc, ignore_merges = PRE_TOKENIZERS[gguf.metadata.get("tokenizer.ggml.pre", "gpt-2")]
    alphabet = _bytes_to_unicode()
    letters = set(alphabet.values())
    # A token outside the byte alphabet is stored as raw text: spell it in the alphabet as the BPE sees it.
    spelled = [t if letters.issuperset(t) else "".join(alphabet[b] for b in t.encode()) for t in tokens]
    merges = gguf.array("tokenizer.ggml.merges") or []
    tok = Tokenizer(
        models.BPE(
            {t: i for i, t in enumerate(spelled)},
            [tuple(m.split(" ", 1)) for m in merges],
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=ignore_merges,
        )
    )
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
    # A "control" token spelled outside the byte alphabet is a mislabel in some files; adding it would grow
    # the vocabulary, so it is left.
    return tok, letters.issuperset


def _sentencepiece(gguf: GGUFFile, tokens: list[str], types: list[int]):
    """SentencePiece BPE with byte fallback, merges ranked by the joined piece's score; returns it and which
    tokens can be added whole (all)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    meta = gguf.metadata
    scores = gguf.array("tokenizer.ggml.scores")
    scores = [float(s) for s in scores] if scores is not None else [-float(i) for i in range(len(tokens))]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    merges = []
    for piece, score, kind in zip(tokens, scores, types):
        if kind in (_UNUSED, _BYTE) or len(piece) < 2:
            continue
        merges.extend(
            (score, piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab
        )
    # best score first; among equal scores llama.cpp joins the leftmost pair, which no rank can say: keep file order
    merges.sort(key=lambda m: -m[0])
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if isinstance(unk, int) and unk < len(tokens) else None
    tok = Tokenizer(
        models.BPE(vocab, [(a, b) for _, a, b in merges], unk_token=unk_token, fuse_unk=True, byte_fallback=True)
    )
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", _SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), replace]) if prefix else replace
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok, lambda t: True


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the rest map to code points from 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping

"""Encoder GGUF files (llama.cpp's `bert` architecture: all-MiniLM, bge, mxbai-embed-large; XLM-RoBERTa's
bge-m3 and bge-reranker, which its converter writes as `bert` too; `nomic-bert`: nomic-embed-text) as a model
folder, and their tensors.

The folder is what an encoder's Hugging Face folder holds: config.json (positions from 0: the converter cut
RoBERTa's offset rows; the pooling and, for `pooling_type` rank, the classifier, from the metadata) and a
tokenizer.json that splits text as llama.cpp does:

- `bert` (WordPiece): llama.cpp's vocabulary writes a word's first piece with "▁" and its continuations bare;
  here they are BERT's pieces again (bare, and "##" continuations) under BERT's normaliser and pre-tokeniser
  (lowercase and accents stripped as `tokenizer.ggml.normalizer.lowercase` says; older files, without the key,
  lowercase), `[CLS] a [SEP]` and a pair's `[CLS] a [SEP] b [SEP]`;
- `t5` (SentencePiece Unigram, XLM-RoBERTa's): the pieces and scores with the file's precompiled character
  map, "▁" for spaces (one before the text where `add_space_prefix` says, runs of spaces merged where
  `remove_extra_whitespaces` does: llama.cpp's defaults, off, where the file is silent), `<s> a </s>` and
  `<s> a </s></s> b </s>`.

Weights keep their GGUF names here and are renamed to the Hugging Face ones the loader knows
(engine/encoders/loader.py), dequantised to float32.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from minibatch.engine.gguf.reader import GGUFFile

ARCHITECTURES = ("bert", "nomic-bert")
VOCABULARIES = ("bert", "t5")
# llama.cpp's pooling_type: 1 mean, 2 cls, 4 rank (a classifier over the first token)
_POOLING = {1: "mean", 2: "cls", 4: "rank"}
_SPACE = "\u2581"
_CONTROL = 3
_TOP = {
    "token_embd": "embeddings.word_embeddings",
    "position_embd": "embeddings.position_embeddings",
    "token_types": "embeddings.token_type_embeddings",
    "token_embd_norm": "embeddings.LayerNorm",
    "cls": "pooler.dense",  # the head: out(tanh(dense(first))), BERT's pooler + classifier as RoBERTa's
    "cls.output": "classifier",
}
_LAYER = {
    "attn_qkv": "attention.self.qkv",  # stacked (NomicBERT)
    "ffn_gate": "intermediate.gate",
    "attn_q": "attention.self.query",
    "attn_k": "attention.self.key",
    "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense",
    "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense",
    "ffn_down": "output.dense",
    "layer_output_norm": "output.LayerNorm",
}


def can_prepare(gguf: GGUFFile) -> str | None:
    """None when write_model_files covers this encoder file, else what it does not cover."""
    vocab = gguf.metadata.get("tokenizer.ggml.model")
    if vocab not in VOCABULARIES:
        return f"an encoder's tokenizer model {vocab!r} ({', '.join(VOCABULARIES)} are covered)"
    pooling = gguf.metadata.get(f"{gguf.architecture}.pooling_type", 1)
    if pooling not in _POOLING:
        return f"pooling_type {pooling} (mean, cls and rank are covered)"
    return None


def write_model_files(gguf: GGUFFile, out: Path) -> None:
    """config.json and the tokenizer files of an encoder GGUF (can_prepare must be None)."""
    meta, arch = gguf.metadata, gguf.architecture

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    shapes = {t.name: tuple(reversed(t.dims)) for t in gguf.tensors}
    pooling = _POOLING[get("pooling_type", 1)]
    tokens = gguf.array("tokenizer.ggml.tokens")
    config = {
        "model_type": "nomic_bert" if arch == "nomic-bert" else "bert",
        "architectures": ["BertForSequenceClassification" if pooling == "rank" else "BertModel"],
        "vocab_size": len(tokens),
        "hidden_size": get("embedding_length"),
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": get("attention.head_count"),
        "layer_norm_eps": float(str(np.float32(get("attention.layer_norm_epsilon", 1e-12)))),
        "max_position_embeddings": shapes["position_embd.weight"][0]
        if "position_embd.weight" in shapes
        else get("context_length"),
        "type_vocab_size": shapes["token_types.weight"][0] if "token_types.weight" in shapes else 1,
        "hidden_act": "gelu",
        "pooling": pooling,
    }
    if arch == "nomic-bert":  # rotary positions, SwiGLU, no biases
        config["rope_theta"] = float(str(np.float32(get("rope.freq_base", 10000.0))))
        config["hidden_act"] = "swiglu"
    if pooling == "rank":
        config["num_labels"] = shapes["cls.output.weight"][0] if "cls.output.weight" in shapes else 1
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _write_tokenizer(gguf, [str(t) for t in tokens], out)


def _write_tokenizer(gguf: GGUFFile, tokens: list[str], out: Path) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    meta = gguf.metadata
    types = gguf.array("tokenizer.ggml.token_type")
    types = [int(t) for t in types] if types is not None else [1] * len(tokens)

    def token_id(*keys: str) -> int | None:
        for key in keys:
            value = meta.get(f"tokenizer.ggml.{key}")
            if isinstance(value, int) and 0 <= value < len(tokens):
                return value
        return None

    unk = token_id("unknown_token_id")
    cls, sep = token_id("cls_token_id", "bos_token_id"), token_id("seperator_token_id", "eos_token_id")
    pad, mask = token_id("padding_token_id"), token_id("mask_token_id")
    if meta.get("tokenizer.ggml.model") == "bert":
        pieces = [t if k == _CONTROL else t[1:] if t.startswith(_SPACE) else "##" + t for t, k in zip(tokens, types)]
        vocab = {}
        for i, piece in enumerate(pieces):
            vocab.setdefault(piece, i)
        tok = Tokenizer(models.WordPiece(vocab, unk_token=pieces[unk] if unk is not None else "[UNK]"))
        lower = bool(meta.get("tokenizer.ggml.normalizer.lowercase", True))
        tok.normalizer = normalizers.BertNormalizer(lowercase=lower, strip_accents=lower)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        pair = "$A:0 {sep}:0 $B:1 {sep}:1"
    else:
        pieces = list(tokens)
        scores = gguf.array("tokenizer.ggml.scores")
        table = [(p, float(s)) for p, s in zip(pieces, scores)]
        tok = Tokenizer(models.Unigram(table, unk_id=unk, byte_fallback=False))
        charsmap = gguf.array("tokenizer.ggml.precompiled_charsmap")
        steps = [normalizers.Precompiled(bytes(np.asarray(charsmap, dtype=np.uint8)))] if charsmap is not None else []
        if meta.get("tokenizer.ggml.remove_extra_whitespaces", False):  # (llama.cpp's defaults when unsaid)
            steps.append(normalizers.Replace(Regex(" {2,}"), " "))
        tok.normalizer = normalizers.Sequence(steps)
        prepend = "always" if meta.get("tokenizer.ggml.add_space_prefix", False) else "never"
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend)
        tok.decoder = decoders.Metaspace(prepend_scheme=prepend)
        pair = "$A:0 {sep}:0 {sep}:0 $B:0 {sep}:0"
    named = {"unk_token": unk, "cls_token": cls, "sep_token": sep, "pad_token": pad, "mask_token": mask}
    named = {name: pieces[i] for name, i in named.items() if i is not None}
    special = {pieces[i] for i, k in enumerate(types) if k == _CONTROL} | set(named.values())
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in sorted(special)])
    if cls is not None and sep is not None:
        c, s = pieces[cls], pieces[sep]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{c}:0 $A:0 {s}:0",
            pair=f"{c}:0 " + pair.format(sep=s),
            special_tokens=[(c, cls), (s, sep)],
        )
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "TokenizersBackend", "clean_up_tokenization_spaces": False, **named}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor of this architecture (None: not one of an encoder's)."""
    module, _, leaf = gguf_name.rpartition(".")
    if module in _TOP:
        return f"{_TOP[module]}.{leaf}"
    parts = module.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER:
        return f"encoder.layer.{parts[1]}.{_LAYER[parts[2]]}.{leaf}"
    return None


def tensors(path: Path) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(Hugging Face name, a function that reads it as float32) for every tensor of the file; a name that is
    not an encoder's comes back as the GGUF's (the loader names it as unexpected)."""
    from minibatch.engine.gguf.tensors import GGUFError
    from minibatch.kernels.cpu.quant import dequantize_ref
    from minibatch.kernels.quant_types import QUANT_BY_ID

    f = GGUFFile(path)
    for info in f.tensors:
        qtype = QUANT_BY_ID.get(info.ggml_type)
        if qtype is None:
            raise GGUFError(f"{path}: tensor {info.name} has ggml type {info.ggml_type}, which is not read here")
        shape = tuple(reversed(info.dims))
        k = shape[-1]
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1

        def read(info=info, qtype=qtype, shape=shape, k=k, rows=rows) -> torch.Tensor:
            raw = f.data(info, rows * qtype.row_bytes(k)).reshape(rows, -1)
            blocks = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True))
            return dequantize_ref(blocks, qtype, k).reshape(shape)

        yield hf_name(info.name) or info.name, read


def summary(path: Path) -> str:
    """What the file's matrices are stored as (its most common type), for /health's `weights`."""
    from collections import Counter

    from minibatch.kernels.quant_types import QUANT_BY_ID

    kinds = Counter(t.ggml_type for t in GGUFFile(path).tensors if len(t.dims) >= 2)
    top = kinds.most_common(1)[0][0] if kinds else 0
    return QUANT_BY_ID[top].name if top in QUANT_BY_ID else f"ggml type {top}"

"""A GGUF's config and tokenizer, written by our reader, say what transformers' GGUF reader says."""

from __future__ import annotations

import dataclasses
import json
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import transformers

from minibatch.engine.gguf.prepare import can_prepare, write_model_files
from minibatch.engine.gguf.reader import GGUFFile
from minibatch.engine.models.config import ModelConfig
from minibatch.engine.text.tokenizer import TextTokenizer

from .test_tokenizer import CONVERSATIONS, TEXTS

CORPUS = TEXTS + [
    "in 2024 we sold 1,234.56 apples; x1y22z333 and 4444444",
    "Don't we'll they've I'M YOU'RE",
    "a\n\n\nb\r\n\tc    d     \n  ",
    "<think>hmm</think> done",
    "ﬁ ligature, Å (A + ring) vs Å",
]


def _builtin_gguf() -> Path:
    from minibatch.engine.store.cache import BUILTIN_MODELS, builtin_gguf_path

    return builtin_gguf_path(BUILTIN_MODELS["smollm2-135m-instruct"])


def _ours(gguf: Path, out: Path) -> Path:
    out.mkdir()
    f = GGUFFile(gguf)
    assert can_prepare(f) is None
    write_model_files(f, out)
    return out


def _assert_same_tokenizer(ours: TextTokenizer, ref, texts: list[str]) -> None:
    for text in texts:
        ids = ours.encode(text)
        assert ids == list(ref.encode(text, add_special_tokens=False)), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    vocab = range(len(ref))
    for skip in (False, True):
        assert [ours.decode([i], skip_special_tokens=skip) for i in vocab] == ref.batch_decode(
            [[i] for i in vocab], skip_special_tokens=skip
        )


@pytest.mark.model
def test_builtin_gguf_prepared_by_us_equals_transformers(tmp_path):
    gguf = _builtin_gguf()
    ours_dir = _ours(gguf, tmp_path / "ours")
    ref = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ours = TextTokenizer(ours_dir)
    assert ours.backend == "tokenizers" and ours.eos_token_id == ref.eos_token_id
    _assert_same_tokenizer(ours, ref, CORPUS)
    # Where the two differ: llama.cpp's "smollm" rule (and the original tokenizer's Digits step) cuts every
    # numeric character off on its own, fractions and superscripts too; transformers' reader uses GPT-2's split.
    assert ours.encode(" ½²") == ours.encode(" ") + ours.encode("½") + ours.encode("²")
    assert ref.encode(" ½²", add_special_tokens=False) != ours.encode(" ½²")
    for messages in CONVERSATIONS:
        assert ours.render_chat(messages) == ref.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
    ref_config = transformers.AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).to_dict()
    ours_cfg, ref_cfg = ModelConfig.from_dir(ours_dir), ModelConfig.from_dict(ref_config)
    # the file stores eps as a float32: ours writes it back as the model's config says it (1e-05),
    # transformers' as the float32's double (9.9999997e-06)
    assert ours_cfg.rms_norm_eps == 1e-05 and np.float32(ref_cfg.rms_norm_eps) == np.float32(1e-05)
    assert ours_cfg == dataclasses.replace(ref_cfg, rms_norm_eps=ours_cfg.rms_norm_eps)
    generation = json.loads((ours_dir / "generation_config.json").read_text())
    assert generation["bos_token_id"] == ref_config["bos_token_id"]
    # the file's EOS first, then what llama.cpp also ends on by its text (SmolLM2's <|endoftext|>)
    assert generation["eos_token_id"] == [ref_config["eos_token_id"], ours.encode("<|endoftext|>")[0]]


def _variant(tmp_path: Path, pre: str | None, arch: str = "llama", **extra) -> Path:
    """The built-in GGUF's vocabulary and merges under another pre-tokenizer name or architecture, no tensors."""
    from gguf import GGUFWriter

    src = GGUFFile(_builtin_gguf())
    path = tmp_path / f"{arch}-{pre}.gguf"
    writer = GGUFWriter(str(path), arch)
    for key in (
        "block_count",
        "context_length",
        "embedding_length",
        "feed_forward_length",
        "attention.head_count",
        "attention.head_count_kv",
        "rope.freq_base",
        "attention.layer_norm_rms_epsilon",
    ):
        value = src.metadata[f"llama.{key}"]
        (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(f"{arch}.{key}", value)
    for key, value in extra.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(src.array("tokenizer.ggml.tokens"))
    types = src.array("tokenizer.ggml.token_type").astype(np.int32)
    types[100] = 4  # one user-defined token: stays whole, decodes as text
    writer.add_token_types(types.tolist())
    writer.add_token_merges(src.array("tokenizer.ggml.merges"))
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        writer.add_uint32(f"tokenizer.ggml.{key}", src.metadata[f"tokenizer.ggml.{key}"])
    writer.add_chat_template(src.metadata["tokenizer.chat_template"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


@pytest.mark.model
@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe"])
def test_split_rules_by_pre_tokenizer_name_equal_transformers(tmp_path, pre):
    gguf = _variant(tmp_path, pre, arch="qwen2")
    ours_dir = _ours(gguf, tmp_path / "ours")
    ours = TextTokenizer(ours_dir)
    ref = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    user_defined = GGUFFile(gguf).array("tokenizer.ggml.tokens")[100]
    texts = [unicodedata.normalize("NFC", t) for t in CORPUS] + [f"x{user_defined}y"]
    _assert_same_tokenizer(ours, ref, texts)
    assert ours.encode(f"x{user_defined}y")[1] == 100  # kept whole
    # the split rule is the named one: Llama 3 groups up to three digits, Qwen2 takes them one by one
    from tokenizers import Tokenizer

    pieces = [
        p for p, _ in Tokenizer.from_file(str(ours_dir / "tokenizer.json")).pre_tokenizer.pre_tokenize_str("12345")
    ]
    assert pieces == (["123", "45"] if pre == "llama-bpe" else list("12345"))


def test_config_from_metadata(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "q3.gguf"
    writer = GGUFWriter(str(path), "qwen3")
    for key, value in {
        "block_count": 2,
        "embedding_length": 64,
        "feed_forward_length": 128,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "attention.key_length": 32,
        "context_length": 512,
    }.items():
        writer.add_uint32(f"qwen3.{key}", value)
    writer.add_float32("qwen3.rope.freq_base", 1e6)
    writer.add_float32("qwen3.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(["a", "b", "ab", "<|im_end|>"])
    writer.add_token_types([1, 1, 1, 3])
    writer.add_token_merges(["a b"])
    writer.add_uint32("tokenizer.ggml.eos_token_id", 3)
    writer.add_uint32("tokenizer.ggml.eot_token_id", 2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    out = tmp_path / "out"
    out.mkdir()
    write_model_files(GGUFFile(path), out)
    cfg = ModelConfig.from_dir(out)
    assert (cfg.model_type, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qk_norm) == ("qwen3", 32, 4, 2, True)
    assert (cfg.vocab_size, cfg.max_position, cfg.rope.theta, cfg.tie_word_embeddings) == (4, 512, 1e6, True)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [3, 2]
    tok = TextTokenizer(out)
    assert tok.encode("abab<|im_end|>") == [2, 2, 3] and tok.decode([2, 3]) == "ab"
    assert not tok.has_chat_template


def test_what_it_does_not_cover_is_named(tmp_path):
    from gguf import GGUFWriter

    for arch, model, pre, why in [
        ("llama", "t5", None, "tokenizer model 't5' (byte-level BPE and SentencePiece BPE are)"),
        ("llama", "gpt2", "mystery-bpe", "pre-tokenizer 'mystery-bpe'"),
        ("gemma", "llama", None, "architecture 'gemma'"),
    ]:
        path = tmp_path / f"{arch}-{model}.gguf"
        writer = GGUFWriter(str(path), arch)
        writer.add_tokenizer_model(model)
        if pre:
            writer.add_tokenizer_pre(pre)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        assert can_prepare(GGUFFile(path)) == why


def _sentencepiece_gguf(tmp_path: Path, space_prefix: bool, symbols=("<think>", "</think>")):
    """A SentencePiece BPE vocabulary trained here (byte fallback, user-defined tokens: `symbols`) and written to a
    GGUF as llama.cpp's converter writes one (pieces, scores, token types; Gemma's add_space_prefix false)."""
    import io

    import sentencepiece as spm
    from gguf import GGUFWriter

    prompts = [
        json.loads(line)["prompt"] for line in (Path(__file__).parents[2] / "scripts/data/chat_prompts.jsonl").open()
    ]
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(prompts + TEXTS),
        model_writer=proto,
        vocab_size=700,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        add_dummy_prefix=space_prefix,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        user_defined_symbols=list(symbols),
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    n = sp.get_piece_size()
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
    for symbol in symbols:
        types[sp.piece_to_id(symbol)] = 4
    path = tmp_path / f"spm-{space_prefix}.gguf"
    writer = GGUFWriter(str(path), "llama")
    for key, value in {
        "block_count": 1,
        "context_length": 64,
        "embedding_length": 64,
        "feed_forward_length": 128,
        "attention.head_count": 4,
    }.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
    writer.add_token_scores([sp.get_score(i) for i in range(n)])
    writer.add_token_types(types)
    writer.add_unk_token_id(sp.unk_id())
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_add_bos_token(True)
    if not space_prefix:
        writer.add_add_space_prefix(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return sp, path, prompts


@pytest.mark.parametrize("space_prefix", [True, False], ids=["llama-prefix-space", "gemma-no-prefix"])
def test_a_sentencepiece_vocabulary_splits_text_as_sentencepiece_does(tmp_path, space_prefix):
    sp, gguf, prompts = _sentencepiece_gguf(tmp_path, space_prefix)
    ours = TextTokenizer(_ours(gguf, tmp_path / "ours"))
    assert ours.backend == "tokenizers"
    texts = (
        prompts
        + [t for t in CORPUS if "think>" not in t]
        + [
            "  leading spaces and trailing   ",
            "\ttabs\tand\nnewlines\n\n",
            "ünïcödé 日本語 🎉 (byte fallback)",
            "1234567890",
            "▁ already a piece mark",
            "",
        ]
    )
    for text in texts:
        ids = ours.encode(text)
        assert ids == sp.encode(text), text
        assert ours.decode(ids) == sp.decode(ids) == (text if "▁" not in text else text.replace("▁", " "))
    assert any(sp.is_byte(i) for t in texts for i in sp.encode(t))  # the byte fallback was exercised
    # llama.cpp encodes the text between special tokens piece by piece, each with its own leading "▁"
    # (SentencePiece itself, which matches user-defined symbols inside the text, adds it only at the start)
    think = sp.piece_to_id("<think>")
    assert ours.encode("why<think>so") == ours.encode("why") + [think] + ours.encode("so")
    assert ours.decode(ours.encode("why<think>so")) == ("why<think> so" if space_prefix else "why<think>so")
    # a raw prompt starts with BOS (add_bos_token), a chat template's text gets none added
    assert ours.encode_prompt("hello") == [sp.bos_id()] + sp.encode("hello")
    assert ours.encode("</s>hello")[0] == sp.eos_id() and ours.decode([sp.eos_id(), *sp.encode("hi")]) == "hi"

"""Fill-in-the-middle: the markers found in each family's vocabulary, and the prompt laid out as llama-server's
/infill lays it out (repository-level with file markers, else chunks behind a plain separator), cut to fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from minibatch.engine.text.fim import CHUNK_SEPARATOR, CURRENT_FILE, REPO_NAME, FimTokens, Infill, assemble

QWEN = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]


def vocab_of(names):
    return {n: 100 + i for i, n in enumerate(names)} | {"a": 1, "b": 2}


@pytest.mark.parametrize(
    "names, want",
    [
        (QWEN, FimTokens(100, 101, 102, None, 103, 104, 105)),
        (["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<fim_pad>"], FimTokens(100, 101, 102, None, 103)),
        (["▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"], FimTokens(100, 101, 102, 103)),
        (["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"], FimTokens(100, 101, 102)),
        (["[PREFIX]", "[SUFFIX]", "[MIDDLE]"], FimTokens(100, 101, 102)),
        (["<fim_prefix>", "<fim_suffix>"], None),  # no middle marker: no fill-in-the-middle
        (["<|im_start|>", "<|im_end|>"], None),  # a chat model's vocabulary
    ],
)
def test_the_markers_are_the_models_own(names, want):
    assert FimTokens.of(vocab_of(names)) == want


def test_the_stops_are_the_end_pad_and_file_markers():
    assert FimTokens(1, 2, 3, end=4).stops == (4,)
    assert set(FimTokens(1, 2, 3, None, 5, 6, 7).stops) == {5, 6, 7}


def encode(text: str) -> list[int]:
    return [1000 + ord(c) for c in text]  # a character a token: lengths are plain to count


def test_repository_level_layout_with_file_markers_and_a_bos():
    fim = FimTokens(100, 101, 102, None, 103, 104, 105)
    infill = Infill("def f(", "):\n", prompt="x", extra=[("a.py", "A"), ("b.py", "BB")])
    got = assemble(fim, encode, infill, context=4096, max_tokens=16, bos=9)
    want = [
        fim.repo,
        *encode(REPO_NAME),
        fim.file_sep,
        *encode("a.py\n"),
        *encode("A"),
        fim.file_sep,
        *encode("b.py\n"),
        *encode("BB"),
        fim.file_sep,
        *encode(CURRENT_FILE),
        9,
        fim.prefix,
        *encode("def f("),
        *encode("x"),
        fim.suffix,
        *encode("):\n"),
        fim.middle,
    ]
    assert got == want


def test_without_file_markers_chunks_go_behind_a_separator():
    fim = FimTokens(100, 101, 102, end=103)
    got = assemble(fim, encode, Infill("p", "s", extra=[("a.py", "A")]), context=4096, max_tokens=0)
    assert got == [*encode(CHUNK_SEPARATOR), *encode("A"), fim.prefix, *encode("p"), fim.suffix, *encode("s"), 102]


def test_the_window_keeps_the_prefix_end_and_the_suffix_start_three_to_one():
    fim = FimTokens(100, 101, 102)
    prefix, suffix = "".join(chr(65 + i % 26) for i in range(500)), "".join(chr(97 + i % 26) for i in range(500))
    got = assemble(fim, encode, Infill(prefix, suffix, prompt="zz"), context=4096, max_tokens=0, window=400)
    head = got.index(fim.prefix)
    cut_prefix = got[head + 1 : got.index(fim.suffix) - 2]
    cut_suffix = got[got.index(fim.suffix) + 1 : -1]
    assert cut_prefix == encode(prefix)[-300:]  # its last 3/4 of the window
    assert cut_suffix == encode(suffix)[: 100 - 2 - 2]  # its first quarter, less the markers and the prompt


def test_chunks_fill_what_the_context_leaves_the_oldest_cut_first():
    fim = FimTokens(100, 101, 102, None, 103, 104, 105)
    extra = [("old.py", "o" * 300), ("new.py", "n" * 50)]
    got = assemble(fim, encode, Infill("p", "s", extra=extra), context=600, max_tokens=50, window=256)
    head = got.index(fim.prefix)
    kept = got[:head]
    room = 600 - 256 - 2 * 50
    assert len(kept) == room  # every token the context leaves, and no more
    full = [fim.repo, *encode(REPO_NAME), fim.file_sep, *encode("old.py\n"), *encode("o" * 300), fim.file_sep,
            *encode("new.py\n"), *encode("n" * 50), fim.file_sep, *encode(CURRENT_FILE)]  # fmt: skip
    assert kept == full[-room:]  # the newest chunk whole, the oldest's start gone


def test_a_ggufs_own_named_markers_come_before_the_names(tmp_path):
    import sys

    from minibatch.engine.store.cache import prepare_gguf
    from minibatch.engine.text.tokenizer import TextTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "dev"))
    from make_model import Shape, write_gguf

    shape = Shape("llama", 64, 128, 1, 2, 1, 32, True, False, 1e4, 1e-5, 512, 49160)  # 8 tokens past the built-in's
    path = tmp_path / "coder.gguf"
    write_gguf("tiny coder", shape, path, "F32", None, 0, true_vocab=True, fim=True)
    tok = TextTokenizer(prepare_gguf(path, tmp_path / "prepared"))
    # the file's metadata names 49152... (Qwen2.5-Coder's names, in make_model's order: prefix, middle, suffix)
    assert tok.fim == FimTokens(prefix=49152, suffix=49154, middle=49153, pad=49155, repo=49156, file_sep=49157)
    vocab = vocab_of(QWEN)
    named = {"prefix": 1, "suffix": 2, "middle": 100}  # metadata wins over names; ids past the vocabulary do not
    assert FimTokens.of(vocab, named) == FimTokens(1, 2, 100)
    assert FimTokens.of(vocab, {"prefix": 1, "suffix": 2, "middle": 999}) == FimTokens.of(vocab)


def test_a_codellama_style_sentencepiece_model_has_no_repository_markers_and_a_bos(tmp_path):
    """CodeLlama's markers are pieces of a SentencePiece vocabulary (▁<PRE>, ▁<SUF>, ▁<MID>, ▁<EOT>), with a BOS
    the tokenizer adds and no repository or file markers: chunks go behind the separator, the prefix part after
    the BOS, and EOT ends the middle."""
    from minibatch.engine.text.tokenizer import TextTokenizer
    from tests.engine.test_gguf_prepare import _ours, _sentencepiece_gguf

    marks = ("▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>")
    sp, gguf, _ = _sentencepiece_gguf(tmp_path, True, symbols=marks)
    tok = TextTokenizer(_ours(gguf, tmp_path / "ours"))
    pre, suf, mid, eot = (sp.piece_to_id(m) for m in marks)
    assert tok.fim == FimTokens(pre, suf, mid, eot) and tok.added_bos == sp.bos_id()
    assert tok.fim.stops == (eot,)
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    ids = assemble(tok.fim, tok.encode, Infill(prefix, suffix, "a", [("util.py", "x = 1\n")]), 4096, 8, tok.added_bos)
    extra = tok.encode(CHUNK_SEPARATOR) + tok.encode("x = 1\n")
    want = extra + [sp.bos_id(), pre, *tok.encode(prefix), *tok.encode("a"), suf, *tok.encode(suffix), mid]
    assert ids == want
    assert tok.encode(prefix) == sp.encode(prefix)  # the tokenizer is SentencePiece's own


def test_texts_far_past_the_window_are_cut_before_encoding_and_give_the_same_prompt(builtin_model_dir):
    """With max_token_bytes, the tokenizer sees about the bytes the layout can keep, not the texts (a 3.9 MB
    prefix was encoded whole, holding the interpreter), and the prompt is token for token the whole texts'."""
    from minibatch.engine.text.tokenizer import TextTokenizer

    tok = TextTokenizer(builtin_model_dir)
    fim = FimTokens(100, 101, 102, None, 103, 104, 105)
    code = "".join(f"    value_{i} = compute({i}, 'ünïcode ✓')\n" for i in range(8000))  # 380 KB
    chunks = [(f"f{i}.py", code[i:]) for i in range(4)]  # 1.5 MB
    infill = Infill(code, code, "    return ", chunks)
    given = 2 * len(code.encode()) + sum(len(t.encode()) for _, t in chunks)
    seen = []

    def encode(text: str) -> list[int]:
        seen.append(len(text.encode()))
        return tok.encode(text)

    for context, max_tokens in ((8192, 64), (2048, 0)):
        whole = assemble(fim, tok.encode, infill, context, max_tokens, 1)
        seen.clear()
        cut = assemble(fim, encode, infill, context, max_tokens, 1, max_token_bytes=tok.max_token_bytes)
        assert cut == whole
        window = min(2048, context)
        room = max(0, context - window - 2 * max_tokens)
        bound = (window + room + 3 * 64) * tok.max_token_bytes + 1000  # (+ the file names and separators)
        assert sum(seen) <= bound < given, (seen, bound, given)

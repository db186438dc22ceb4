"""/tokenize and /detokenize on the real daemon: round trips, a conversation's ids as its chat request's
prompt, the special tokens as the flags say, pieces, and refusals naming the field."""

from __future__ import annotations

import pytest

from minibatch.daemon.client import request_json
from minibatch.engine.text.tokenizer import TextTokenizer

from .helpers import running_daemon

TEXTS = ["Hello, world!", "  leading spaces and ünïcödé — 你好", "<|im_start|>user\nhi<|im_end|>", "a" * 500]


@pytest.fixture(scope="module")
def daemon(tiny_chat_model_dir):
    with running_daemon(tiny_chat_model_dir, "--kv-cache-gb", "0.05", prefix="mbk-") as d:
        yield d


def post(daemon, path: str, body: dict) -> tuple[int, dict]:
    return request_json(str(daemon.socket), "POST", path, body, timeout=30)


def test_texts_round_trip_and_special_tokens_follow_the_flags(daemon, tiny_chat_model_dir):
    tok = TextTokenizer(tiny_chat_model_dir)
    for text in TEXTS:
        status, out = post(daemon, "/tokenize", {"content": text})
        assert status == 200 and out["tokens"] == tok.encode(text) and out["count"] == len(out["tokens"])
        assert out["max_model_len"] == 1024
        status, back = post(daemon, "/detokenize", {"tokens": out["tokens"]})
        assert status == 200 and back["content"] == text
        assert post(daemon, "/tokenize", {"content": back["content"]})[1]["tokens"] == out["tokens"]
        with_special = post(daemon, "/tokenize", {"content": text, "add_special": True})[1]["tokens"]
        assert with_special == tok.encode_prompt(text)
    pieces = post(daemon, "/tokenize", {"content": TEXTS[0], "with_pieces": True})[1]["tokens"]
    assert "".join(p["piece"] for p in pieces) == TEXTS[0] and all(isinstance(p["id"], int) for p in pieces)


def test_a_conversation_counts_what_its_chat_request_will_cost(daemon):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    status, out = post(daemon, "/tokenize", {"messages": messages})
    assert status == 200
    status, answer = post(daemon, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert status == 200 and answer["usage"]["prompt_tokens"] == out["count"] == len(out["tokens"])


@pytest.mark.parametrize(
    "path,body,field",
    [
        ("/tokenize", {}, "content"),
        ("/tokenize", {"content": "x", "messages": [{"role": "user", "content": "x"}]}, "content"),
        ("/tokenize", {"content": "x", "tools": []}, "tools"),
        ("/tokenize", {"content": 5}, "content"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens.1"),
        ("/detokenize", {"tokens": [-1]}, "tokens.0"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(daemon, path, body, field):
    status, out = post(daemon, path, body)
    assert status == 400 and out["error"]["param"] == field, out

"""A request names models, not files: only what the catalog lists resolves; every other name is the same 404
(whatever the filesystem holds where it points), nothing a client sends is kept, and no answer shows a server
path. Also what a client cannot break: /health after a huge keep_alive, a header that is not text."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from minibatch.engine.store import cache, sources

from .helpers import Daemon, keyed_daemon


@pytest.fixture(scope="module")
def tree(tiny_chat_model_dir):
    """A shallow models folder (/tmp/mbn-X/models, so "../../dev/zero" from it is /dev/zero) holding a model
    directory, a FIFO and a link to /dev/zero named as GGUF files, and an empty Ollama store and hub cache."""
    root = Path(tempfile.mkdtemp(prefix="mbn-", dir="/tmp"))
    models = root / "models"
    models.mkdir()
    shutil.copytree(tiny_chat_model_dir, models / "tiny")
    os.mkfifo(models / "pipe.gguf")
    (models / "zero.gguf").symlink_to("/dev/zero")
    (models / "notes").mkdir()  # a directory that is no model
    (root / "secret.txt").write_text("x")
    env = {
        "MINIBATCH_MODELS_DIR": str(models),
        "OLLAMA_MODELS": str(root / "ollama"),
        "HF_HUB_CACHE": str(root / "hub"),
    }
    yield root, env
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon(tree, tiny_chat_model_dir):
    root, env = tree
    d = Daemon(root / "d.sock", tiny_chat_model_dir, "--kv-cache-gb", "0.05", env=env).wait_ready()
    yield d
    assert d.stop() == 0, d.log_text()


def post(daemon, url: str, body: dict) -> tuple[int, dict]:
    from minibatch.daemon.client import request_json

    return request_json(str(daemon.socket), "POST", url, body, timeout=30)


def ask(daemon, name: str) -> tuple[int, str]:
    status, body = post(
        daemon,
        "/v1/chat/completions",
        {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    return status, body["error"]["message"] if status != 200 else ""


def test_only_listed_names_resolve(tree, monkeypatch):
    root, env = tree
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cache.listed_spec("tiny") == "local:tiny"
    assert cache.listed_spec("tiny:latest") == "local:tiny"
    assert cache.listed_spec(f"{cache.DEFAULT_MODEL}:latest") == cache.DEFAULT_MODEL
    for name in (
        "../secret.txt",
        "~",
        "~root",
        "/etc/passwd",
        "../../dev/zero",
        "pipe",
        "zero",
        "notes",
        ".",
        "..",
        "tiny/config.json",
        "a" * 300,
        "org/../x",
        "hf:../x",
        "ollama:x",
        "nosuch",
    ):
        assert cache.listed_spec(name) is None, name
    assert "tiny" in cache.servable_names() and "pipe" not in cache.servable_names()
    assert sources.resolve_local("zero") is None and sources.resolve_local("pipe") is None


def test_every_unlisted_name_is_the_same_404_whatever_the_filesystem_holds(daemon, tree):
    root, _ = tree
    names = [
        "../secret.txt",
        "../models/tiny/config.json",
        "/etc/passwd",
        "/etc",
        "~",
        "../../dev/zero",
        "pipe",
        "zero",
        "notes",
        "nosuch",
        "nosuch.gguf",
        f"{root}/models/tiny",
    ]
    texts = {}
    for name in names:
        status, text = ask(daemon, name)
        assert status == 404, (name, text)
        texts[name] = text.replace(repr(name), "NAME")
    assert len(set(texts.values())) == 1, texts
    text = next(iter(texts.values()))
    assert "tiny" in text and str(root) not in text and "/" not in text.replace("GET /v1/models", "")
    assert ask(daemon, "tiny")[0] == 200  # the listed one loads
    daemon.wait_idle()


def test_what_a_client_sends_is_not_kept_and_no_answer_shows_a_server_path(daemon, tree):
    root, _ = tree
    _, before = daemon.get("/health")
    for i in range(20):
        status, text = ask(daemon, f"{i}" + "b" * 1_000_000 + ":latest")
        assert status == 404 and len(text) < 2000, text[:200]
    status, health = daemon.get("/health")
    assert status == 200 and health["load_errors"] == before["load_errors"]
    raw = json.dumps(health)
    assert len(raw) < 2 * len(json.dumps(before)) and "model_dir" not in raw
    for url in ("/v1/models", "/api/tags", "/health"):
        assert str(root) not in json.dumps(daemon.get(url)[1]), url


@pytest.mark.parametrize("value", [1e12, "100000000h", 1e300])
def test_a_keep_alive_past_its_range_is_a_400_and_health_stays_200(daemon, value):
    status, body = post(
        daemon,
        "/api/chat",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "stream": False,
            "keep_alive": value,
            "options": {"num_predict": 2},
        },
    )
    assert status == 400 and body["error"].startswith("keep_alive: at most 8760h"), body
    assert daemon.get("/health")[0] == 200 and daemon.get("/api/ps")[0] == 200
    status, _ = post(
        daemon,
        "/api/chat",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "stream": False,
            "keep_alive": "8760h",
            "options": {"num_predict": 2},
        },
    )
    assert status == 200 and daemon.get("/health")[0] == 200


def test_a_key_header_that_is_not_text_is_a_401(tiny_chat_model_dir):
    with keyed_daemon(tiny_chat_model_dir, "k" * 24) as d:
        port = int(d.url.rsplit(":", 1)[1])
        for header in (b"Authorization: Bearer \xff\xfe", b"x-api-key: \xe9\xe9", b"Authorization: Bearer \xc3\xa9"):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n" + header + b"\r\nConnection: close\r\n\r\n")
                reply = b""
                while chunk := s.recv(65536):
                    reply += chunk
            assert reply.startswith(b"HTTP/1.1 401"), (header, reply[:200])
        assert d.get("/health")[0] == 200


def test_a_long_name_is_cut_in_every_answer_that_shows_it(daemon):
    """A name the client sent comes back at most 64 characters long, wherever an answer shows it."""
    long = "m" * 300
    status, body = daemon.get(f"/v1/engine/stats?model={long}")
    assert status == 404 and len(body["error"]["message"]) < 200 and "m" * 65 not in body["error"]["message"], body
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    status, body = post(
        daemon,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": long}},
        },
    )
    assert status == 400 and body["error"]["param"] == "tool_choice.function.name", body
    assert "m" * 65 not in body["error"]["message"], body
    for url in ("/v1/chat/completions", "/api/chat"):
        status, body = post(daemon, url, {"model": long, "messages": [{"role": "user", "content": "hi"}]})
        message = body["error"]["message"] if isinstance(body["error"], dict) else body["error"]
        assert status == 404 and "m" * 65 not in message, body

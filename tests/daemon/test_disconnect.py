"""A client that goes away before the first byte of its answer, in every API face, streaming and not: the
real daemon aborts the request at once, frees its blocks and keeps serving (the engine's counters say so,
not only the status of the next request).

Each request asks for 900 tokens of the tiny random model (it almost never says EOS: ~2 s of decoding), and
the client closes its socket right after sending it, or a few milliseconds later, so the daemon's handler is
cancelled wherever it is: parsing, rendering, between submitting and reading its stream, or streaming. A
request left decoding would keep the engine busy for seconds; an aborted one is gone within a step."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import types
from typing import cast

import pytest
from aiohttp import web

from daemon.state import DaemonState, read_raw

from .helpers import running_daemon, with_fim_markers

FACES = {
    "openai": ("/v1/chat/completions", lambda m, s: {"model": m, "messages": ASK, "max_tokens": 900, "stream": s}),
    "ollama": ("/api/chat", lambda m, s: {"model": m, "messages": ASK, "stream": s, "options": {"num_predict": 900}}),
    "anthropic": ("/v1/messages", lambda m, s: {"model": m, "messages": ASK, "max_tokens": 900, "stream": s}),
    "responses": ("/v1/responses", lambda m, s: {"model": m, "input": "Hello!", "max_output_tokens": 900, "stream": s}),
    # an editor's fill-in-the-middle, superseded by its next keystroke: llama-server's, OpenAI's and Ollama's
    "infill": (
        "/infill",
        lambda m, s: {"model": m, "input_prefix": "def f(", "input_suffix": ")\n", "n_predict": 900, "stream": s},
    ),
    "openai-fim": (
        "/v1/completions",
        lambda m, s: {"model": m, "prompt": "def f(", "suffix": ")\n", "max_tokens": 900, "stream": s},
    ),
    "ollama-fim": (
        "/api/generate",
        lambda m, s: {"model": m, "prompt": "def f(", "suffix": ")\n", "stream": s, "options": {"num_predict": 900}},
    ),
}
ASK = [{"role": "user", "content": "Hello!"}]
DELAYS = (0.0, 0.003, 0.02)  # seconds between sending the request and closing the socket


@pytest.fixture(scope="module")
def daemon(tiny_chat_model_dir, tmp_path_factory):
    model = with_fim_markers(tiny_chat_model_dir, tmp_path_factory.mktemp("gone") / "model")  # a coder's markers
    with running_daemon(model, "--kv-cache-gb", "0.05", prefix="mbx-") as d:
        yield d


def send_and_leave(path: str, url: str, body: dict, delay: float) -> None:
    data = json.dumps(body).encode()
    head = f"POST {url} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(data)}\r\n\r\n"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        s.sendall(head.encode() + data)
        if delay:
            time.sleep(delay)


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "whole"])
@pytest.mark.parametrize("face", sorted(FACES))
def test_a_client_gone_before_the_answer_leaves_nothing_running(daemon, face, stream):
    _, health = daemon.get("/health")
    model = health["model"]
    url, body = FACES[face]
    finished_before = daemon.stats()["requests_finished"]
    for delay in DELAYS:
        send_and_leave(str(daemon.socket), url, body(model, stream), delay)
        daemon.wait_idle(timeout=1.0)  # a request left decoding would hold the engine for seconds
    # the daemon keeps serving, and what it was asked was ended, not lost
    status, answer = daemon.get("/health")
    assert status == 200 and answer["model"] == model
    assert daemon.stats()["requests_finished"] >= finished_before


class _BodyJustCome:
    """An aiohttp request's body that comes after one turn of the event loop."""

    async def read(self) -> bytes:
        await asyncio.sleep(0)
        return b"{}"


@pytest.mark.parametrize("turns", range(6))
def test_a_cancel_as_the_body_comes_is_never_lost(turns):
    """The handler is cancelled (its client gone) at every point of reading the body, the moment it came
    included: the cancel ends the read, never lost to it (Python 3.11's wait_for returned the body then, and the
    request ran to its end for nobody)."""
    state = types.SimpleNamespace(body_timeout=5.0)

    async def main() -> None:
        task = asyncio.ensure_future(read_raw(cast(web.Request, _BodyJustCome()), cast(DaemonState, state)))
        for _ in range(turns):
            await asyncio.sleep(0)
        if task.cancel():  # False: it had already returned the body
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            assert task.result() == b"{}"

    asyncio.run(main())

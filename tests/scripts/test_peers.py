"""The peer harness against a fake OpenAI server on loopback that records what it received,
and the peer command lines. Nothing here builds or starts a real peer."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from aiohttp import web

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from bench import body_of  # noqa: E402
from benchlib import text_trace  # noqa: E402
from peers import llamacpp, minibatch, vllm  # noqa: E402
from peers.compare import WorkMismatch, check_counts, point_traces, replay_http  # noqa: E402


class FakeOpenAI:
    """/v1/completions streaming like llama-server: usage beside the last choice. `short` answers one token less."""

    def __init__(self, short: set[int] = frozenset()) -> None:
        self.received: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.short = short

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        index = len(self.received)
        self.received.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            n = body["max_tokens"] - (1 if index in self.short else 0)
            for i in range(n):
                await asyncio.sleep(0.002)
                last = i == n - 1
                chunk = {"choices": [{"text": f"t{i} ", "index": 0, "finish_reason": "length" if last else None}]}
                if last:
                    chunk["usage"] = {"completion_tokens": n, "prompt_tokens": len(body["prompt"].split())}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self.in_flight -= 1


def serve_and_replay(fake: FakeOpenAI, trace, concurrency: int):
    async def go():
        app = web.Application()
        app.router.add_post("/v1/completions", fake.completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            return await replay_http({"url": f"http://127.0.0.1:{port}"}, trace, concurrency, body_of)
        finally:
            await runner.cleanup()

    return asyncio.run(go())


def test_trace_is_replayed_in_order_with_forced_lengths_and_bounded_concurrency():
    trace = text_trace(12, (16, 64), (8, 20), seed=4)
    fake = FakeOpenAI()
    results, wall = serve_and_replay(fake, trace, concurrency=3)
    assert [b["prompt"] for b in fake.received] == [it.prompt_text for it in trace]  # sent in trace order
    assert all(16 <= len(b["prompt"].split()) <= 64 for b in fake.received)
    assert all(
        b["max_tokens"] == it.max_tokens and b["ignore_eos"] and b["temperature"] == 0
        for b, it in zip(fake.received, trace)
    )
    assert fake.max_in_flight == 3
    check_counts(trace, results, "fake")  # every count as asked: passes
    assert [r.output_tokens for r in results] == [it.max_tokens for it in trace] and wall > 0


def test_a_short_answer_fails_the_run_loudly():
    trace = text_trace(6, (16, 64), (8, 20), seed=5)
    results, _ = serve_and_replay(FakeOpenAI(short={2}), trace, concurrency=2)
    with pytest.raises(
        WorkMismatch,
        match=rf"(?s)fake: 1 of 6 responses .*request 2: asked {trace[2].max_tokens}, got {trace[2].max_tokens - 1}",
    ):
        check_counts(trace, results, "fake")


def test_text_trace_is_reproducible():
    assert text_trace(5, (16, 64), (8, 128), seed=1) == text_trace(5, (16, 64), (8, 128), seed=1)
    assert text_trace(5, (16, 64), (8, 128), seed=1) != text_trace(5, (16, 64), (8, 128), seed=2)


def test_each_point_gets_at_least_per_client_requests_per_client():
    from types import SimpleNamespace

    args = SimpleNamespace(
        concurrencies="1,16,64", requests=32, per_client=2, words=(16, 64), output_len=(8, 128), seed=0
    )
    traces = point_traces(args)
    assert {c: len(t) for c, t in traces.items()} == {1: 32, 16: 32, 64: 128}
    assert traces[64][:32] == traces[1] == text_trace(32, (16, 64), (8, 128), seed=0)  # the same first requests
    args.per_client = 0
    assert {c: len(t) for c, t in point_traces(args).items()} == {1: 32, 16: 32, 64: 32}
    # each repeat its own prompts, the same shape of work: no server answers a run from its memory of the last
    second = point_traces(args, run=1)
    assert {it.prompt_text for it in second[1]}.isdisjoint(it.prompt_text for it in traces[1])
    assert second[1] == text_trace(32, (16, 64), (8, 128), seed=1) and len(second[64]) == 32


def test_llama_server_command_line():
    argv = llamacpp.command(
        Path("/opt/llama-server"), Path("/m/q.gguf"), 18931, concurrency=16, threads=2, ctx_per_slot=512
    )
    assert argv[:3] == ["/opt/llama-server", "-m", "/m/q.gguf"]
    joined = " ".join(argv)
    assert "--host 127.0.0.1 --port 18931" in joined and "-t 2 -tb 2" in joined
    assert "-np 16 -c 8192" in joined  # one KV buffer, split evenly over the 16 slots
    assert "--no-webui" in argv and "-cb" in argv


def test_llama_server_not_found_says_how(monkeypatch, tmp_path):
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit, match="--llama-server PATH or set LLAMA_SERVER"):
        llamacpp.find_server(None)


def test_vllm_command_line():
    argv = vllm.command("/models/smollm2", 18931, concurrency=64, max_model_len=512)
    joined = " ".join(argv)
    assert "/models/smollm2" in argv and "--host 127.0.0.1 --port 18931" in joined
    assert "--max-num-seqs 64" in joined and "--max-model-len 512" in joined


def test_minibatch_peer_command_line():
    argv = minibatch.command("/tmp/x.sock", "native", concurrency=4, threads=2, model="smollm2-135m-instruct")
    assert argv[0].endswith("minibatchd") and argv[1] == "start"
    joined = " ".join(argv)
    assert "--socket /tmp/x.sock" in joined and "--weights native" in joined and "--max-num-seqs 4" in joined
    assert "--no-prefix-caching" in argv  # a replayed trace must not hit its previous run's cache
    sized = " ".join(
        minibatch.command("/tmp/x.sock", "native", concurrency=16, threads=2, model="m", kv_tokens=16 * 512)
    )
    assert "--kv-cache-tokens 8192" in sized  # the token slots llama.cpp gets with -c 8192

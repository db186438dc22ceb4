"""Ollama's API against the real daemon: the ollama client library over the socket, NDJSON streams, errors."""

from __future__ import annotations

import json

import pytest

from .helpers import running_daemon, session

ollama = pytest.importorskip("ollama")
httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def daemon(tiny_chat_model_dir):
    with running_daemon(tiny_chat_model_dir, "--max-num-seqs", "4", "--kv-cache-gb", "0.05", prefix="mbo-") as daemon:
        yield daemon


def client(daemon) -> ollama.Client:
    return ollama.Client(host="http://localhost", transport=httpx.HTTPTransport(uds=str(daemon.socket)))


def test_the_ollama_client_lists_chats_and_generates(daemon, tiny_chat_model_dir):
    c = client(daemon)
    name = tiny_chat_model_dir.name
    listed = c.list()
    # the served model first, then what else the machine holds (loaded on first use)
    assert [m.model for m in listed.models][0] == f"{name}:latest"
    assert "smollm2-135m-instruct:latest" in [m.model for m in listed.models]
    assert c.show(name).details.family == "llama"
    assert c.ps().models[0].model == f"{name}:latest"
    answer = c.chat(
        model=name, messages=[{"role": "user", "content": "Hello!"}], options={"temperature": 0, "num_predict": 5}
    )
    assert answer.message.role == "assistant" and answer.done and answer.eval_count == 5
    assert answer.done_reason == "length" and answer.prompt_eval_count > 0 and answer.total_duration > 0
    parts = list(
        c.chat(
            model=f"{name}:latest",
            messages=[{"role": "user", "content": "Hello!"}],
            stream=True,
            options={"temperature": 0, "num_predict": 5},
        )
    )
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content for p in parts) == answer.message.content  # greedy: the same text
    gen = c.generate(model=name, prompt="Once upon a time", options={"temperature": 0, "num_predict": 4, "seed": 1})
    assert gen.done and gen.eval_count == 4 and isinstance(gen.response, str)
    streamed = list(
        c.generate(model=name, prompt="Once upon a time", stream=True, options={"temperature": 0, "num_predict": 4})
    )
    assert "".join(p.response for p in streamed) == gen.response
    assert c.generate(model=name, prompt="").done  # an empty prompt only "loads" the model, as Ollama does


def test_ollama_errors_use_its_shape_and_name_the_field(daemon, tiny_chat_model_dir):
    import asyncio

    name = tiny_chat_model_dir.name

    async def go():
        out = {}
        async with session(daemon.socket) as s:
            for key, path, body in (
                (
                    "temp",
                    "/api/chat",
                    {"model": name, "messages": [{"role": "user", "content": "x"}], "options": {"temperature": 5}},
                ),
                ("model", "/api/chat", {"model": "llama3.2", "messages": [{"role": "user", "content": "x"}]}),
                ("role", "/api/chat", {"messages": [{"role": "robot", "content": "x"}]}),
                ("json", "/api/generate", None),
                (
                    "ignored",
                    "/api/generate",
                    {
                        "prompt": "hi",
                        "stream": False,
                        "keep_alive": "5m",
                        "options": {"num_ctx": 4096, "num_predict": 2},
                    },
                ),
            ):
                kwargs = {"data": b"{nope"} if body is None else {"json": body}
                async with s.post(path, **kwargs) as r:
                    out[key] = r.status, await r.json()
            async with s.post(
                "/api/chat",
                json={"messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": 3, "temperature": 0}},
            ) as r:
                out["ndjson"] = r.headers["Content-Type"], [json.loads(line) for line in (await r.read()).splitlines()]
            async with s.get("/api/nothing") as r:
                out["404"] = r.status, await r.json()
        return out

    out = asyncio.run(go())
    assert out["temp"][0] == 400 and "options.temperature" in out["temp"][1]["error"]
    assert out["model"][0] == 404 and "llama3.2" in out["model"][1]["error"]
    assert out["role"][0] == 400 and "messages.0.role" in out["role"][1]["error"]
    assert out["json"][0] == 400 and "not valid JSON" in out["json"][1]["error"]
    assert (
        out["ignored"][0] == 200 and out["ignored"][1]["eval_count"] == 2
    )  # unknown options are ignored, as Ollama does
    ctype, lines = out["ndjson"]
    assert ctype.startswith("application/x-ndjson") and lines[-1]["done"] and lines[-1]["eval_count"] == 3
    assert out["404"][0] == 404 and set(out["404"][1]) == {"error"}
    assert daemon.wait_idle()["kv_blocks_used"] == 0


def test_openai_endpoints_take_the_name_ollama_lists(daemon, tiny_chat_model_dir):
    """Ollama clients (oterm through pydantic-ai) send /api/tags' name, tag and all, to /v1/chat/completions."""
    listed = client(daemon).list().models[0].model
    assert listed.endswith(":latest")

    async def go():
        async with session(daemon.socket) as s:
            body = {"model": listed, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            async with s.post("http://localhost/v1/chat/completions", json=body) as r:
                return r.status, await r.json()

    import asyncio

    status, body = asyncio.run(go())
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"


def test_a_tool_call_whose_arguments_are_no_json_object_goes_to_the_content():
    """A model may write `"arguments": "not json"` (or a number): Ollama's clients read arguments as an object,
    so such a call is given back as text rather than answered with a 500."""
    from minibatch.daemon.api.ollama import ollama_calls

    calls = [
        {"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"function": {"name": "get_weather", "arguments": "Paris, please"}},
        {"function": {"name": "count", "arguments": "5"}},
    ]
    made, unmade = ollama_calls(calls)
    assert made == [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert [json.loads(u) for u in unmade] == [
        {"name": "get_weather", "arguments": "Paris, please"},
        {"name": "count", "arguments": "5"},
    ]

"""One generation through all four API faces: OpenAI's chat, Ollama's chat, Anthropic's Messages and OpenAI's
Responses ask the real daemon for the same thing, whole and streamed, and get the same text, the same number
of tokens and the same finish reason, each in its own words.

The model is the tiny chat model with a template that renders tools and a generation_config.json whose
sampling (temperature, top-k, a repetition penalty) every face must apply where the request leaves it out.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from pathlib import Path

import pytest

from minibatch.daemon.client import request_json

from .helpers import Daemon, save_tools_model, session
from .test_tools import TOOLS_TEMPLATE, WEATHER

MODEL_DEFAULTS = {"temperature": 0.9, "top_k": 20, "repetition_penalty": 1.3}
PROMPT = "Write about the sea."
# Each face's word for the two ways the tests end: the length limit and a stop string.
LENGTH = {"openai": "length", "ollama": "length", "anthropic": "max_tokens", "responses": "incomplete"}
STOPPED = {"openai": "stop", "ollama": "stop", "anthropic": "stop_sequence", "responses": "completed"}
FACES = tuple(LENGTH)


@pytest.fixture(scope="module")
def daemon(tiny_chat_model_dir, tmp_path_factory):
    model = save_tools_model(tiny_chat_model_dir, tmp_path_factory.mktemp("contract"), TOOLS_TEMPLATE)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, **MODEL_DEFAULTS}))
    d = tempfile.mkdtemp(prefix="mbc-", dir="/tmp")
    daemon = Daemon(Path(d) / "c.sock", model, "--max-num-seqs", "8", "--kv-cache-gb", "0.05").wait_ready()
    daemon.model = daemon.get("/health")[1]["model"]  # Anthropic's API requires the name
    yield daemon
    assert daemon.stop() == 0, daemon.log_text()
    shutil.rmtree(d, ignore_errors=True)


def body_for(face: str, ask: dict, model: str) -> tuple[str, dict]:
    """(path, body) asking `face` for `ask`: max_tokens, and any of temperature, seed, stop, schema, tool."""
    msgs = [{"role": "user", "content": PROMPT}]
    n = ask["max_tokens"]
    if face == "openai":
        body = {"messages": msgs, "max_tokens": n}
        body |= {k: ask[k] for k in ("temperature", "top_p", "seed", "stop") if k in ask}
        if "schema" in ask:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": ask["schema"]}}
        if "tool" in ask:
            body |= {"tools": [ask["tool"]], "tool_choice": "required"}
        return "/v1/chat/completions", body | ask.get("samplers", {})
    if face == "ollama":
        options = {"num_predict": n} | {k: ask[k] for k in ("temperature", "top_p", "seed", "stop") if k in ask}
        body = {"messages": msgs, "options": options | ask.get("samplers", {})}
        if "schema" in ask:
            body["format"] = ask["schema"]
        return "/api/chat", body
    if face == "anthropic":
        body = {"model": model, "messages": msgs, "max_tokens": n}
        body |= {k: ask[k] for k in ("temperature", "top_p", "seed") if k in ask}
        if "stop" in ask:
            body["stop_sequences"] = ask["stop"]
        if "schema" in ask:
            body["output_config"] = {"format": {"type": "json_schema", "schema": ask["schema"]}}
        if "tool" in ask:
            f = ask["tool"]["function"]
            body["tools"] = [{"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}]
            body["tool_choice"] = {"type": "any"}
        return "/v1/messages", body
    body = {"input": PROMPT, "max_output_tokens": n}
    body |= {k: ask[k] for k in ("temperature", "top_p", "seed") if k in ask}
    if "schema" in ask:
        body["text"] = {"format": {"type": "json_schema", "name": "s", "schema": ask["schema"]}}
    if "tool" in ask:
        body |= {"tools": [{"type": "function", **ask["tool"]["function"]}], "tool_choice": "required"}
    return "/v1/responses", body


def read_whole(face: str, r: dict) -> tuple[str, int, str, list]:
    """(text, output tokens, finish reason, calls as (name, arguments)) from a whole answer."""
    if face == "openai":
        c = r["choices"][0]
        made = c["message"].get("tool_calls") or []
        calls = [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in made]
        return c["message"]["content"] or "", r["usage"]["completion_tokens"], c["finish_reason"], calls
    if face == "ollama":
        return r["message"]["content"], r["eval_count"], r["done_reason"], []
    if face == "anthropic":
        text = "".join(b["text"] for b in r["content"] if b["type"] == "text")
        calls = [(b["name"], b["input"]) for b in r["content"] if b["type"] == "tool_use"]
        return text, r["usage"]["output_tokens"], r["stop_reason"], calls
    text = "".join(p["text"] for item in r["output"] if item["type"] == "message" for p in item["content"])
    calls = [(i["name"], json.loads(i["arguments"])) for i in r["output"] if i["type"] == "function_call"]
    return text, r["usage"]["output_tokens"], r["status"], calls


def sse(raw: bytes) -> list[dict]:
    out = []
    for block in raw.decode().split("\n\n"):
        data = [line[6:] for line in block.split("\n") if line.startswith("data: ")]
        if data and data[0] != "[DONE]":
            out.append(json.loads(data[0]))
    return out


def read_stream(face: str, raw: bytes) -> tuple[str, int, str, list]:
    """The same four from a streamed answer, put together from its events."""
    if face == "openai":
        text, finish, calls, count = [], None, [], None
        for e in sse(raw):
            if e.get("usage"):
                count = e["usage"]["completion_tokens"]
            for c in e["choices"]:
                text.append(c["delta"].get("content") or "")
                for t in c["delta"].get("tool_calls") or []:
                    calls.append((t["function"]["name"], json.loads(t["function"]["arguments"])))
                finish = c["finish_reason"] or finish
        return "".join(text), count, finish, calls
    if face == "ollama":
        lines = [json.loads(x) for x in raw.decode().splitlines() if x.strip()]
        return "".join(x["message"]["content"] for x in lines), lines[-1]["eval_count"], lines[-1]["done_reason"], []
    events = sse(raw)
    if face == "anthropic":
        text, names, inputs = [], [], []
        for e in events:
            if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use":
                names.append(e["content_block"]["name"])
            elif e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta":
                text.append(e["delta"]["text"])
            elif e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta":
                inputs.append(json.loads(e["delta"]["partial_json"]))
        end = next(e for e in events if e["type"] == "message_delta")
        return "".join(text), end["usage"]["output_tokens"], end["delta"]["stop_reason"], list(zip(names, inputs))
    done = events[-1]["response"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    calls = [(i["name"], json.loads(i["arguments"])) for i in done["output"] if i["type"] == "function_call"]
    return text, done["usage"]["output_tokens"], done["status"], calls


async def ask_every_face(daemon, ask: dict, faces=FACES) -> dict[tuple[str, bool], tuple]:
    """Each face's answer to `ask`, whole and streamed, all at once (they share the batch)."""

    async def one(s, face: str, streamed: bool):
        path, body = body_for(face, ask, daemon.model)
        if face == "openai" and streamed:
            body["stream_options"] = {"include_usage": True}
        async with s.post(path, json={**body, "stream": streamed}) as resp:
            raw = await resp.read()
            assert resp.status == 200, (face, streamed, raw[:500])
            return read_stream(face, raw) if streamed else read_whole(face, json.loads(raw))

    async with session(daemon.socket) as s:
        keys = [(face, streamed) for face in faces for streamed in (False, True)]
        return dict(zip(keys, await asyncio.gather(*(one(s, *k) for k in keys))))


def test_greedy_is_the_same_through_every_face(daemon):
    got = asyncio.run(ask_every_face(daemon, {"temperature": 0, "max_tokens": 12}))
    texts = {k: v[0] for k, v in got.items()}
    assert len(set(texts.values())) == 1 and texts[("openai", False)], got
    for (face, streamed), (_, count, finish, _) in got.items():
        assert (count, finish) == (12, LENGTH[face]), (face, streamed)
    daemon.wait_idle()


def test_seeded_sampling_with_the_models_defaults_is_the_same_through_every_face(daemon):
    """No temperature in the request: the model's (0.9, top-k 20, repetition penalty 1.3) everywhere; the same
    seed draws the same tokens. Greedy answers differently, so the defaults did apply. (top_p is set: the
    APIs' own defaults for it differ, Ollama's 0.9 and the others' 1.)"""
    got = asyncio.run(ask_every_face(daemon, {"seed": 11, "top_p": 0.95, "max_tokens": 16}))
    assert len({v[0] for v in got.values()}) == 1, {k: v[0][:24] for k, v in got.items()}
    assert all(v[1:3] == (16, LENGTH[f]) for (f, _), v in got.items()), got
    greedy = asyncio.run(ask_every_face(daemon, {"temperature": 0, "max_tokens": 16}, faces=("openai",)))
    assert greedy[("openai", False)][0] != got[("openai", False)][0]
    daemon.wait_idle()


def test_a_stop_string_ends_the_answer_the_same_way_through_every_face_that_has_one(daemon):
    (full, *_), *_ = asyncio.run(ask_every_face(daemon, {"temperature": 0, "max_tokens": 24}, ("openai",))).values()
    stop = full.strip()[4:7]
    assert len(stop) == 3 and stop in full
    faces = ("openai", "ollama", "anthropic")  # the Responses API has no stop strings
    got = asyncio.run(ask_every_face(daemon, {"temperature": 0, "max_tokens": 24, "stop": [stop]}, faces))
    for (face, streamed), (text, _, finish, _) in got.items():
        assert (text, finish) == (full[: full.index(stop)], STOPPED[face]), (face, streamed)
    daemon.wait_idle()


def test_a_json_schema_is_followed_the_same_way_through_every_face(daemon):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    got = asyncio.run(ask_every_face(daemon, {"temperature": 0, "max_tokens": 48, "schema": schema}))
    texts = {v[0] for v in got.values()}
    assert len(texts) == 1, got
    value = json.loads(texts.pop())
    assert set(value) == {"name", "n"} and isinstance(value["n"], int)
    daemon.wait_idle()


def test_a_required_tool_call_is_the_same_call_through_every_face_that_can_force_one(daemon):
    faces = ("openai", "anthropic", "responses")  # Ollama's API cannot require a call
    got = asyncio.run(ask_every_face(daemon, {"temperature": 0, "max_tokens": 64, "tool": WEATHER}, faces))
    calls = {json.dumps(v[3], sort_keys=True) for v in got.values()}
    assert len(calls) == 1, got
    (name, args), *rest = next(iter(got.values()))[3]
    assert name == "get_weather" and set(args) == {"city", "unit"} and not rest
    daemon.wait_idle()


@pytest.mark.parametrize(
    "samplers",
    [
        {"typical_p": 0.8, "top_n_sigma": 2.0, "xtc_probability": 0.5, "dry_multiplier": 0.8},
        {"mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2},
    ],
    ids=["typical-sigma-xtc-dry", "mirostat"],
)
def test_llama_servers_samplers_are_the_same_through_every_face_with_a_place_for_them(daemon, samplers):
    """OpenAI's chat takes them as extra fields, Ollama's as options: the same seed draws the same tokens
    through both, and not those it draws without them (so they applied)."""
    ask = {"seed": 5, "top_p": 0.95, "max_tokens": 16}
    faces = ("openai", "ollama")
    got = asyncio.run(ask_every_face(daemon, {**ask, "samplers": samplers}, faces))
    assert len({v[0] for v in got.values()}) == 1, {k: v[0][:24] for k, v in got.items()}
    plain = asyncio.run(ask_every_face(daemon, ask, ("openai",)))
    assert plain[("openai", False)][0] != got[("openai", False)][0]
    daemon.wait_idle()


def test_a_sampler_setting_out_of_range_is_a_400_naming_it_in_each_faces_terms(daemon):
    for face, samplers, param in [
        ("openai", {"typical_p": 0}, "typical_p"),
        ("openai", {"mirostat": 1}, "mirostat"),
        ("ollama", {"mirostat": 1}, "options.mirostat"),
        ("ollama", {"dry_sequence_breakers": [""]}, "options.dry_sequence_breakers.0"),
    ]:
        path, body = body_for(face, {"max_tokens": 4, "samplers": samplers}, daemon.model)
        status, answer = request_json(str(daemon.socket), "POST", path, {**body, "stream": False}, timeout=30)
        assert status == 400, (face, samplers, answer)
        error = answer["error"]  # OpenAI's an object naming the param, Ollama's a message
        assert error["param"] == param if face == "openai" else error.startswith(f"{param}: "), answer
    assert daemon.wait_idle()["kv_blocks_used"] == 0

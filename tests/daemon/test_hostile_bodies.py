"""Bodies a hostile client sends, through every place a JSON schema enters (OpenAI's response_format and tool
parameters, Ollama's format, Anthropic's output_config, the Responses API's text.format): a schema nested
past the schema limit, a body nested past the body limit, and one nested past Python's own parser; and the
Anthropic bodies Anthropic refuses (a thinking budget not below max_tokens, a tool_result that answers no
tool_use). Each is a 400 naming the field, and nothing reaches the engine."""

from __future__ import annotations

import json
import socket
import sys

import pytest

from minibatch.daemon.protocol import MAX_BODY_DEPTH
from minibatch.engine.text.structured import MAX_SCHEMA_DEPTH

from .helpers import running_daemon

ASK = [{"role": "user", "content": "hi"}]
# face -> (url, body with the schema, the field the error names, how the face nests the error)
PLACES = {
    "openai response_format": (
        "/v1/chat/completions",
        lambda m, s: {
            "model": m,
            "messages": ASK,
            "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}},
        },  # noqa: E501
        "response_format.json_schema.schema",
    ),
    "openai tool parameters": (
        "/v1/chat/completions",
        lambda m, s: {
            "model": m,
            "messages": ASK,
            "max_tokens": 4,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": s}}],
        },  # noqa: E501
        "tools.0.function.parameters",
    ),
    "ollama format": (
        "/api/chat",
        lambda m, s: {"model": m, "messages": ASK, "stream": False, "format": s, "options": {"num_predict": 4}},
        "format",
    ),
    "anthropic output_config": (
        "/v1/messages",
        lambda m, s: {
            "model": m,
            "max_tokens": 4,
            "messages": ASK,
            "output_config": {"format": {"type": "json_schema", "schema": s}},
        },  # noqa: E501
        "output_config.format.schema",
    ),
    "responses text.format": (
        "/v1/responses",
        lambda m, s: {
            "model": m,
            "input": "hi",
            "max_output_tokens": 4,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": s}},
        },  # noqa: E501
        "text.format.schema",
    ),
}


@pytest.fixture(scope="module")
def daemon(tools_model_dir):
    with running_daemon(tools_model_dir, "--kv-cache-gb", "0.05", prefix="mbh-") as d:
        yield d


@pytest.fixture(scope="module")
def tools_model_dir(tiny_chat_model_dir, tmp_path_factory):
    from .helpers import save_tools_model
    from .test_tools import TOOLS_TEMPLATE

    return save_tools_model(tiny_chat_model_dir, tmp_path_factory.mktemp("tiny-tools-hostile"), TOOLS_TEMPLATE)


def nested(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def post(path: str, url: str, raw: bytes) -> tuple[int, str]:
    """POST raw bytes over the socket (a body too deep for json.dumps to write is written by hand)."""
    head = f"POST {url} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(raw)}\r\nConnection: close\r\n\r\n"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        s.sendall(head.encode() + raw)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    status = int(reply.split(b" ", 2)[1])
    return status, reply.split(b"\r\n\r\n", 1)[1].decode(errors="replace")


def dumps(body: dict) -> bytes:
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20_000))
    try:
        return json.dumps(body).encode()
    finally:
        sys.setrecursionlimit(limit)


@pytest.mark.parametrize("place", sorted(PLACES))
def test_schemas_and_bodies_nested_too_deep_are_refused_naming_the_field(daemon, place):
    url, body, field = PLACES[place]
    _, health = daemon.get("/health")
    model = health["model"]
    before = daemon.stats()["requests_finished"]
    # Past the schema limit, within the body's: the schema's own field, from the grammar compiler.
    status, text = post(str(daemon.socket), url, dumps(body(model, nested(MAX_SCHEMA_DEPTH // 2 + 2))))
    assert status == 400 and f"nests deeper than {MAX_SCHEMA_DEPTH} levels" in text, text
    assert json.loads(text) and text.count(f"{field}: ") == 1, text  # the message starts with the field
    # Past the body limit: the field it nests in, named by its first keys, before anything walks it.
    status, text = post(str(daemon.socket), url, dumps(body(model, nested(300))))
    assert status == 400 and f"nests deeper than {MAX_BODY_DEPTH} levels" in text, text
    assert json.loads(text) and field.split(".")[0] in text
    # Past what the JSON parser itself takes: the body as a whole.
    status, text = post(str(daemon.socket), url, dumps(body(model, nested(3000))))
    assert status == 400 and f"body nests deeper than {MAX_BODY_DEPTH} levels" in text, text
    stats = daemon.stats()
    assert stats["requests_finished"] == before and stats["running"] == 0 and stats["kv_blocks_used"] == 0
    assert daemon.get("/health")[0] == 200


ORPHAN = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "w", "input": {}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "21"}]},
]


@pytest.mark.parametrize(
    "body,field",
    [
        (
            {"max_tokens": 16, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 16}},
            "thinking.budget_tokens",
        ),
        ({"max_tokens": 16, "messages": ORPHAN}, "messages.2.content.0.tool_use_id"),
    ],
    ids=["thinking budget past max_tokens", "tool_result answering no tool_use"],
)
def test_anthropic_bodies_anthropic_refuses_are_refused(daemon, body, field):
    before = daemon.stats()["requests_finished"]
    status, text = post(str(daemon.socket), "/v1/messages", dumps({"model": "default", **body}))
    error = json.loads(text)
    assert status == 400 and error["type"] == "error" and error["error"]["type"] == "invalid_request_error", text
    assert error["error"]["message"].startswith(f"{field}: "), text
    assert daemon.stats()["requests_finished"] == before


@pytest.mark.parametrize(
    "kind,body,param,says",
    [
        (
            "anthropic",
            {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "foo", "text": "x"}]}]},
            "messages.0.content.0",
            "does not match any of the expected tags",
        ),
        (
            "responses",
            {"model": "m", "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
            "input.0.content.0",
            "tag 'input_file'",
        ),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "bogus"}]}]},
            "messages.0.content.0",
            "tag 'bogus'",
        ),
        ("anthropic", {"model": "m", "max_tokens": 4}, "messages", "Field required"),
    ],
)
def test_a_400_names_the_field_as_the_client_wrote_it(kind, body, param, says):
    """Not the union branch pydantic tried first (`messages.0.content.str`, `input.items.0.message.content.str`):
    the branch that reached deepest into the body, named by the body's own keys and indexes."""
    from minibatch.daemon.api.anthropic_bodies import MessagesRequest
    from minibatch.daemon.api.openai_bodies import ChatRequest
    from minibatch.daemon.api.responses_bodies import ResponsesRequest
    from minibatch.daemon.protocol import ApiError, parse_body

    model = {"anthropic": MessagesRequest, "responses": ResponsesRequest, "chat": ChatRequest}[kind]
    with pytest.raises(ApiError) as err:
        parse_body(json.dumps(body).encode(), model)
    assert err.value.status == 400 and err.value.param == param, err.value.message
    assert err.value.message.startswith(f"{param}: ") and says in err.value.message


def _long_chat(n: int = 900, size: int = 3800) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * (size // 5)} for i in range(n)]


LONG = {
    "openai chat": ("/v1/chat/completions", lambda m: {"model": m, "messages": _long_chat()}, "messages"),
    "openai completions": ("/v1/completions", lambda m: {"model": m, "prompt": "word " * 700_000}, "prompt"),
    "ollama": ("/api/chat", lambda m: {"model": m, "messages": _long_chat(), "stream": False}, "messages"),
    "anthropic": ("/v1/messages", lambda m: {"model": m, "messages": _long_chat(), "max_tokens": 8}, "messages"),
    "responses": ("/v1/responses", lambda m: {"model": m, "input": _long_chat()}, "input"),
}


@pytest.mark.parametrize("face", sorted(LONG))
def test_a_prompt_far_past_the_context_is_refused_before_it_is_encoded(daemon, face):
    """3.4 MB of conversation: more bytes than the context's tokens could hold at the longest token's length,
    so it is refused from its size (the message says "at least", where admission would count the tokens),
    naming the field, and nothing is submitted."""
    url, body, field = LONG[face]
    model = daemon.get("/health")[1]["model"]
    before = daemon.stats()["requests_finished"]
    status, text = post(str(daemon.socket), url, json.dumps(body(model)).encode())
    assert status == 400, text[:300]
    assert f"{field}: the prompt is " in text and "bytes, at least" in text and "context limit" in text, text[:300]
    stats = daemon.stats()
    assert stats["requests_finished"] == before and stats["running"] == 0 and stats["kv_blocks_used"] == 0

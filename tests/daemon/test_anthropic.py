"""Anthropic's Messages API against the real daemon, with the official `anthropic` SDK: over TCP with a key
(sent as x-api-key, as the SDK sends it) and over the socket; the built-in model for text, a tiny model with
a tools template for forced calls."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import httpx
import jsonschema
import pytest

from minibatch.daemon.api.anthropic import template_messages
from minibatch.daemon.api.anthropic_bodies import MessagesRequest
from minibatch.engine.text.tokenizer import TextTokenizer

from .helpers import keyed_daemon, save_tools_model
from .test_tools import HISTORY, TOOLS_TEMPLATE, WEATHER

anthropic = pytest.importorskip("anthropic")
KEY = "test-key-anthropic-0123456789"
TOOL = {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER["function"]["parameters"]}


@pytest.fixture(scope="module")
def tools_model_dir(tiny_chat_model_dir, tmp_path_factory) -> Path:
    return save_tools_model(tiny_chat_model_dir, tmp_path_factory.mktemp("tiny-tools-anthropic"), TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def daemon(tools_model_dir):
    with keyed_daemon(tools_model_dir, KEY, prefix="mba-") as daemon:
        yield daemon


def tcp(daemon, key: str = KEY):
    return anthropic.Anthropic(base_url=daemon.url, api_key=key, max_retries=0, timeout=120)


def over_socket(daemon):
    httpx2 = pytest.importorskip("httpx2")  # the HTTP client today's anthropic SDK is built on
    http = httpx2.Client(transport=httpx2.HTTPTransport(uds=str(daemon.socket)), timeout=120)
    return anthropic.Anthropic(base_url="http://localhost", api_key="unused", max_retries=0, http_client=http)


ASK = [{"role": "user", "content": "Name three colors."}]


def test_text_whole_and_streamed_and_a_stop_sequence(daemon):
    client = tcp(daemon)
    greedy = {"temperature": 0}  # (today's SDK has no sampling arguments; the API takes them)
    whole = client.messages.create(model="smollm2-135m-instruct", max_tokens=24, messages=ASK, extra_body=greedy)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == "smollm2-135m-instruct"
    assert whole.id.startswith("msg_") and [b.type for b in whole.content] == ["text"]
    text = whole.content[0].text
    assert len(text.split()) >= 3 and whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.output_tokens > 0 and whole.usage.input_tokens + whole.usage.cache_read_input_tokens > 5

    with client.messages.stream(model="smollm2-135m-instruct", max_tokens=24, messages=ASK, extra_body=greedy) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == text and final.content[0].text == text  # greedy: the same answer both ways
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens

    word = text.split()[1]  # a stop sequence the answer reaches: cut there, and named
    cut = client.messages.create(
        model="smollm2-135m-instruct", max_tokens=24, messages=ASK, extra_body=greedy, stop_sequences=["zzz", word]
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == text[: text.index(word)]


def test_a_forced_tool_call_follows_its_schema(daemon):
    client = over_socket(daemon)  # the socket: no key needed
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": '{"temp": 21}'},
                {"type": "text", "text": "And in Rome?"},
            ],
        },
    ]
    for seed_temp in (0.0, 1.0):
        r = client.messages.create(
            model="default",
            max_tokens=200,
            system="Be brief.",
            messages=history,
            tools=[TOOL],
            tool_choice={"type": "tool", "name": "get_weather"},
            extra_body={"temperature": seed_temp},
        )
        assert r.stop_reason == "tool_use"
        uses = [b for b in r.content if b.type == "tool_use"]
        assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
        jsonschema.validate(uses[0].input, TOOL["input_schema"])
    with client.messages.stream(
        model="default",
        max_tokens=200,
        messages=history,
        tools=[TOOL],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    ) as s:
        events = list(s)
        final = s.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and "content_block_start" in kinds and kinds[-1] == "message_stop"
    partial = "".join(
        e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    jsonschema.validate(json.loads(partial), TOOL["input_schema"])
    assert final.stop_reason == "tool_use" and final.content[-1].input == json.loads(partial)


def test_output_config_format_constrains_the_answer(daemon):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "maximum": 99}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = tcp(daemon).messages.create(
        model="default",
        max_tokens=80,
        messages=[{"role": "user", "content": "Invent a person."}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    jsonschema.validate(json.loads(r.content[0].text), schema)


def test_count_tokens_is_the_prompt_a_request_gets(daemon):
    client = tcp(daemon)
    counted = client.messages.count_tokens(model="default", messages=ASK, system="Be brief.")
    r = client.messages.create(model="default", max_tokens=1, messages=ASK, system="Be brief.")
    assert counted.input_tokens == r.usage.input_tokens + r.usage.cache_read_input_tokens > 5


def test_errors_take_anthropics_shape_and_name_the_field(daemon):
    client = tcp(daemon)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages", body={"model": "default", "messages": ASK}, cast_to=httpx.Response)
    assert e.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
    }
    with pytest.raises(anthropic.AuthenticationError) as e:
        tcp(daemon, "wrong-key").messages.create(model="default", max_tokens=4, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=4, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error" and "no-such-model" in e.value.body["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="default", max_tokens=4, messages=[{"role": "user", "content": [image]}])
    assert "messages.0.content.0" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="default", max_tokens=4, messages=ASK, extra_body={"temperature": 1.5})
    assert e.value.body["error"]["message"].startswith("temperature:")
    with pytest.raises(anthropic.BadRequestError) as e:  # the model's template renders no tools
        client.messages.create(model="smollm2-135m-instruct", max_tokens=4, messages=ASK, tools=[TOOL])
    assert e.value.body["error"]["message"].startswith("tools:")
    assert daemon.get("/health")[0] == 200  # and the daemon serves on


def test_content_blocks_render_as_the_openai_history_does(tools_model_dir):
    """tool_use / tool_result / system blocks become the same template input as OpenAI's messages."""
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 1,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "tool_use",
                            "id": "call_1",
                            "name": "get_weather",
                            "input": {"city": "Paris", "unit": "c"},
                        }
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "call_1",
                            "content": [{"type": "text", "text": '{"temp": 21}'}],
                        },
                        {"type": "text", "text": "And the time there?"},
                    ],
                },
            ],
        }
    )
    tok = TextTokenizer(tools_model_dir)
    openai_history = [{**m, "content": m["content"] or ""} for m in copy.deepcopy(HISTORY)]  # (HISTORY is shared)
    for m in openai_history:
        for c in m.get("tool_calls", []):
            c["function"] = {**c["function"], "arguments": json.loads(c["function"]["arguments"])}
    assert tok.chat(template_messages(body)) == tok.chat(openai_history)

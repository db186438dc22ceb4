"""OpenAI's Responses API against the real daemon with the official openai SDK (`responses.create`): text whole
and streamed, a function call and its output sent back with previous_response_id, text.format json_schema,
the store's GET / DELETE and its 404s; over the socket and over TCP with a key."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from .helpers import keyed_daemon, save_tools_model
from .test_tools import TOOLS_TEMPLATE, WEATHER

KEY = "test-key-responses-0123456789"
FUNCTION = {"type": "function", **WEATHER["function"]}


@pytest.fixture(scope="module")
def tools_model_dir(tiny_chat_model_dir, tmp_path_factory) -> Path:
    return save_tools_model(tiny_chat_model_dir, tmp_path_factory.mktemp("tiny-tools-responses"), TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def daemon(tools_model_dir):
    with keyed_daemon(tools_model_dir, KEY, prefix="mbr-") as daemon:
        yield daemon


def tcp(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def over_socket(daemon) -> openai.OpenAI:
    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.socket)), timeout=120)
    return openai.OpenAI(base_url="http://localhost/v1", api_key="unused", max_retries=0, http_client=http)


def test_text_whole_and_streamed(daemon):
    client = tcp(daemon)
    r = client.responses.create(
        model="smollm2-135m-instruct", input="Name three colors.", max_output_tokens=24, temperature=0
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and len(r.output_text.split()) >= 3
    assert r.usage.output_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    events = list(
        client.responses.create(
            model="smollm2-135m-instruct",
            input=[{"role": "user", "content": "Name three colors."}],
            max_output_tokens=24,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in kinds and kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_function_call_and_its_output_continue_the_conversation(daemon):
    client = over_socket(daemon)
    first = client.responses.create(
        model="default",
        instructions="Be brief.",
        input="Weather in Paris?",
        tools=[FUNCTION],
        tool_choice="required",
        max_output_tokens=200,
        temperature=0,
    )
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and first.status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])
    output = [{"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temp": 21}'}]
    second = client.responses.create(
        model="default", previous_response_id=first.id, input=output, tools=[FUNCTION], max_output_tokens=4
    )
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
    # the continued prompt holds the first turn and its call before the output: longer than the output alone
    alone = client.responses.create(model="default", input=output, tools=[FUNCTION], max_output_tokens=4)
    assert second.usage.input_tokens > alone.usage.input_tokens + 10
    streamed = list(
        client.responses.create(
            model="default",
            input="Weather in Rome?",
            tools=[FUNCTION],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=200,
            temperature=0,
            stream=True,
        )
    )
    args = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
    assert streamed[-1].type == "response.completed"


def test_text_format_json_schema(daemon):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "maximum": 99}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = tcp(daemon).responses.create(
        model="default",
        input="Invent a person.",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
        max_output_tokens=80,
        temperature=1.0,
    )
    jsonschema.validate(json.loads(r.output_text), schema)


def test_the_store_and_its_errors(daemon):
    client = tcp(daemon)
    r = client.responses.create(model="default", input="Hi", max_output_tokens=2)
    assert client.responses.retrieve(r.id).id == r.id
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(r.id)
    assert "no stored response" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="default", input="Hi", previous_response_id="resp_nope", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model="default", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="default", input="Hi", temperature=5)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="default", input="Hi", text={"format": {"type": "json_schema", "name": "x"}})
    assert e.value.body["param"] == "text.format.schema"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=daemon.url + "/v1", api_key="wrong", max_retries=0).responses.create(
            model="default", input="Hi"
        )


def test_input_tokens_count_the_prompt_a_response_computes(daemon):
    """The SDK's responses.input_tokens.count equals the usage of the same body's response: instructions,
    tools and a stored conversation (previous_response_id) rendered by the template alike."""
    client = over_socket(daemon)
    body = dict(model="default", input="What is the weather in Paris?", instructions="Be brief.")
    first = client.responses.create(**body, tools=[FUNCTION], max_output_tokens=8, temperature=0)
    counted = client.responses.input_tokens.count(**body, tools=[FUNCTION])
    assert counted.object == "response.input_tokens" and counted.input_tokens == first.usage.input_tokens > 10
    follow = dict(model="default", input="And in Rome?", previous_response_id=first.id)
    second = client.responses.create(**follow, max_output_tokens=4, temperature=0)
    assert client.responses.input_tokens.count(**follow).input_tokens == second.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.input_tokens.count(model="default", input="x", previous_response_id="resp_0")

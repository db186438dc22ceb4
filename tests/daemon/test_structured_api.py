"""response_format and Ollama's format against the real daemon and the built-in model, through real clients."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from .helpers import running_daemon

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
ollama = pytest.importorskip("ollama")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "email": {"type": "string", "maxLength": 60},
    },
    "required": ["name", "age", "email"],
    "additionalProperties": False,
}
CASES = [
    ("Invent a person. Reply with their name, age and email.", PERSON),
    (
        "What color is the sky on a clear day?",
        {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    ),
    (
        "List the first five prime numbers.",
        {"type": "array", "items": {"type": "number"}, "minItems": 5, "maxItems": 5},
    ),
    (
        "Describe a user with an id, two tags and whether they are active.",
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer"},
                        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
                    },
                    "required": ["id", "tags"],
                },
                "active": {"type": "boolean"},
            },
            "required": ["user", "active"],
        },
    ),
]


@pytest.fixture(scope="module")
def daemon(builtin_model_dir):
    # The exact path: the cases below follow the model's greedy answers, which 8-bit activations change (the
    # 135M model then nests "any JSON object" past max_tokens); the grammar's guarantees hold on both paths.
    with running_daemon(
        "smollm2-135m-instruct",
        "--max-num-seqs",
        "8",
        "--kv-cache-gb",
        "0.2",
        "--weights",
        "native-exact",
        prefix="mbs-",
    ) as daemon:
        yield daemon


def sdk(daemon) -> openai.OpenAI:
    transport = httpx.HTTPTransport(uds=str(daemon.socket))
    return openai.OpenAI(
        base_url="http://localhost/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(transport=transport, timeout=120),
    )


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.model
def test_the_openai_sdk_gets_json_that_follows_each_schema(daemon):
    client = sdk(daemon)
    for question, schema in CASES:
        r = client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": question}],
            temperature=0,
            max_tokens=200,
            response_format=schema_format(schema),
        )
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    # sampled, streamed, with logprobs: the chunks join to a valid document
    chunks = list(
        client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": CASES[0][0]}],
            temperature=0.8,
            seed=7,
            max_tokens=200,
            stream=True,
            logprobs=True,
            response_format=schema_format(PERSON),
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    # any JSON object, and the legacy completions endpoint
    r = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "A JSON object, please."}],
        temperature=0,
        max_tokens=200,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(
        model="smollm2-135m-instruct",
        prompt="The capital of France as JSON:",
        temperature=0,
        max_tokens=100,
        extra_body={"response_format": schema_format(CASES[1][1])},
    )
    jsonschema.validate(json.loads(r.choices[0].text), CASES[1][1])
    assert daemon.wait_idle()["kv_blocks_used"] == 0


@pytest.mark.model
def test_a_schema_that_cannot_be_used_is_a_400_naming_the_field(daemon):
    client = sdk(daemon)
    for fmt, param in [
        (schema_format({"type": "objectx"}), "response_format.json_schema.schema"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "response_format.json_schema.schema"),
        ({"type": "xml"}, "response_format.type"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="smollm2-135m-instruct",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=5,
                response_format=fmt,
            )
        assert err.value.body["param"] == param, err.value.body
    assert daemon.get("/health")[0] == 200


@pytest.mark.model
def test_the_ollama_client_gets_json_for_format(daemon):
    c = ollama.Client(host="http://localhost", transport=httpx.HTTPTransport(uds=str(daemon.socket)))
    answer = c.chat(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": CASES[0][0]}],
        format=PERSON,
        options={"temperature": 0, "num_predict": 200},
    )
    jsonschema.validate(json.loads(answer.message.content), PERSON)
    parts = list(
        c.generate(
            model="smollm2-135m-instruct",
            prompt="Three colors as JSON.",
            format="json",
            stream=True,
            options={"temperature": 0, "num_predict": 200},
        )
    )
    assert parts[-1].done and isinstance(json.loads("".join(p.response for p in parts)), dict)
    with pytest.raises(ollama.ResponseError) as err:
        c.chat(model="smollm2-135m-instruct", messages=[{"role": "user", "content": "hi"}], format={"type": "objectx"})
    assert err.value.status_code == 400 and "format" in err.value.error


@pytest.mark.model
def test_a_gbnf_grammar_constrains_the_answer_and_a_broken_one_names_its_line(daemon):
    """llama-server's `grammar` field, through the OpenAI SDK's extra_body: chat and completions, whole and
    streamed, GBNF and Lark; a broken grammar is a 400 naming the field, its line and its column."""
    client = sdk(daemon)
    gbnf = 'root ::= "The answer is " ("yes" | "no") "." ( " " [A-Z] [a-z]{1,10} "." ){0,2}\n'
    answer = re.compile(r"The answer is (yes|no)\.( [A-Z][a-z]{1,10}\.){0,2}")
    for temperature in (0, 0.9):
        r = client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "Is the sky blue?"}],
            temperature=temperature,
            seed=3,
            max_tokens=60,
            extra_body={"grammar": gbnf},
        )
        assert r.choices[0].finish_reason == "stop" and answer.fullmatch(r.choices[0].message.content), r
    chunks = client.completions.create(
        model="smollm2-135m-instruct",
        prompt="Is water wet?",
        max_tokens=60,
        stream=True,
        extra_body={"grammar": 'start: "Water is " ("wet" | "dry") "."\n'},
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) in ("Water is wet.", "Water is dry.")
    for body, message in [
        ({"grammar": 'root ::= "a" (\n'}, "grammar: the grammar cannot be used: line 2, column 1:"),
        ({"grammar": 'root ::= "a" b'}, "line 1, column 14: no rule named 'b'"),
        (
            {"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}},
            "grammar: cannot be combined with response_format",
        ),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="smollm2-135m-instruct",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=5,
                extra_body=body,
            )
        assert err.value.body["param"] == "grammar" and message in err.value.body["message"], err.value.body
    assert daemon.wait_idle()["kv_blocks_used"] == 0

"""Function calling against the real daemon: tools rendered by the template, forced calls, calls read back.

The model is a tiny random one with the built-in tokenizer and a Qwen-style template that renders tools:
whatever it would write, a required call must come back as a valid `tool_calls` entry.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import jsonschema
import pytest
import transformers

from minibatch.daemon.generation.tools import CallSplitter, parse_calls
from minibatch.engine.text.tokenizer import TextTokenizer

from .helpers import Daemon, save_tools_model

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' }}

# Tools

You may call functions. Their signatures, inside <tools></tools>:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each call, write the name and arguments as JSON inside <tool_call></tool_call>:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}{% continue %}{% endif %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{{ m.content }}{% for c in m.tool_calls %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "user", "content": "And the time there?"},
]


@pytest.fixture(scope="module")
def tools_model_dir(tiny_chat_model_dir, tmp_path_factory) -> Path:
    return save_tools_model(tiny_chat_model_dir, tmp_path_factory.mktemp("tiny-tools"), TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def daemons(tools_model_dir, tiny_chat_model_dir):
    d = tempfile.mkdtemp(prefix="mbt-", dir="/tmp")
    with_tools = Daemon(Path(d) / "t.sock", tools_model_dir, "--max-num-seqs", "4", "--kv-cache-gb", "0.05")
    plain = Daemon(Path(d) / "p.sock", tiny_chat_model_dir, "--max-num-seqs", "4", "--kv-cache-gb", "0.05")
    yield with_tools.wait_ready(), plain.wait_ready()
    assert with_tools.stop() == 0, with_tools.log_text()
    assert plain.stop() == 0, plain.log_text()
    shutil.rmtree(d, ignore_errors=True)


def sdk(daemon) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://localhost/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.socket)), timeout=120),
    )


def test_tools_and_tool_history_render_as_transformers_renders_them(tools_model_dir):
    ours, ref = TextTokenizer(tools_model_dir), transformers.AutoTokenizer.from_pretrained(tools_model_dir)
    assert ours.supports_tools and ours.tool_call_format == "hermes"
    from minibatch.daemon.api.messages import Message

    messages = [Message.model_validate(m).for_template() for m in HISTORY]
    want = ref.apply_chat_template(messages, tools=[WEATHER, TIME], add_generation_prompt=True, tokenize=False)
    assert ours.render_chat(messages, tools=[WEATHER, TIME]) == want
    assert '"arguments": {"city": "Paris", "unit": "c"}' in want and "<tool_response>" in want and '"get_time"' in want


def test_calls_are_read_back_from_the_output():
    content, calls = parse_calls(
        'Let me check.<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    )
    assert content == "Let me check." and [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls
    ] == [("a", {"x": 1}), ("b", {})]
    assert parse_calls("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert parse_calls("no calls") == ("no calls", [])
    split = CallSplitter()
    sent = "".join(split.push(piece) for piece in ["Sure", ". <tool", '_call>\n{"name": "a", ', '"arguments": {}}'])
    rest, calls = split.finish()
    assert sent + rest == "Sure. " and [c["function"]["name"] for c in calls] == ["a"]
    split = CallSplitter()
    assert split.push("a <tool") == "a " and split.push("box>") == "<toolbox>" and split.finish() == ("", [])


def test_a_required_call_comes_back_valid_as_tool_calls(daemons):
    client = sdk(daemons[0])
    for choice, names in [
        ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
        ("required", {"get_weather", "get_time"}),
    ]:
        for seed in range(3):
            r = client.chat.completions.create(
                model="default",
                messages=HISTORY,
                tools=[WEATHER, TIME],
                tool_choice=choice,
                temperature=1.0,
                seed=seed,
                max_tokens=200,
            )
            c = r.choices[0]
            assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
            call = c.message.tool_calls[0]
            assert call.id.startswith("call_") and call.type == "function" and call.function.name in names
            schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
            jsonschema.validate(json.loads(call.function.arguments), schema)
    # streamed: the call arrives whole in one delta, then finish_reason tool_calls
    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=HISTORY[:2],
            tools=[WEATHER],
            tool_choice="required",
            temperature=0,
            max_tokens=200,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and deltas[0].tool_calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(deltas[0].tool_calls[0].function.arguments), WEATHER["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    # auto: whatever the random model writes comes back as content or calls, and the history is accepted
    r = client.chat.completions.create(
        model="default", messages=HISTORY, tools=[WEATHER, TIME], temperature=0, max_tokens=8
    )
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert daemons[0].wait_idle()["kv_blocks_used"] == 0


def test_tool_requests_that_cannot_work_are_400s_naming_the_field(daemons):
    with_tools, plain = (sdk(d) for d in daemons)
    cases = [
        (plain, dict(tools=[WEATHER]), "tools"),  # the built-in template does not render tools
        (
            with_tools,
            dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
            "tool_choice.function.name",
        ),
        (with_tools, dict(tool_choice="required"), "tool_choice"),
        (
            with_tools,
            dict(
                tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
                tool_choice="required",
            ),
            "tools.0.function.parameters",
        ),
        (with_tools, dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools.0.function.name"),
        (
            with_tools,
            dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
            "response_format",
        ),
    ]
    for client, extra, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=4, **extra
            )
        assert err.value.body["param"] == param, (extra, err.value.body)
    with pytest.raises(openai.BadRequestError) as err:  # a tool message without content
        with_tools.chat.completions.create(
            model="default", messages=[{"role": "tool", "tool_call_id": "x"}], max_tokens=4
        )
    assert err.value.body["param"] == "messages.0"
    for d in daemons:
        assert d.get("/health")[0] == 200


def test_ollama_chat_takes_tools_and_tool_history(daemons):
    ollama = pytest.importorskip("ollama")
    with_tools, plain = (
        ollama.Client(host="http://localhost", transport=httpx.HTTPTransport(uds=str(d.socket))) for d in daemons
    )
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}],
        },
        {"role": "tool", "content": '{"temp": 21}', "tool_name": "get_weather"},
    ]
    answer = with_tools.chat(
        model="default", messages=history, tools=[WEATHER, TIME], options={"temperature": 0, "num_predict": 6}
    )
    assert answer.done and answer.prompt_eval_count > 0
    # the rendered prompt held the call and its result: it is longer than the same chat without them
    short = with_tools.chat(model="default", messages=history[:1], tools=[WEATHER, TIME], options={"num_predict": 1})
    assert answer.prompt_eval_count > short.prompt_eval_count
    parts = list(
        with_tools.chat(
            model="default",
            messages=history,
            tools=[WEATHER],
            stream=True,
            options={"temperature": 0, "num_predict": 6},
        )
    )
    assert parts[-1].done
    with pytest.raises(ollama.ResponseError) as err:
        plain.chat(model="default", messages=history[:1], tools=[WEATHER])
    assert err.value.status_code == 400 and "tools" in err.value.error

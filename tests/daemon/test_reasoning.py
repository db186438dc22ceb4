"""A thinking model's reasoning apart from its answer: the splitter on its own, then the real daemon with a tiny
model whose template thinks (Qwen3's switch, a generation prompt that opens `<think>` as DeepSeek-R1's does)
and whose vocabulary has `<think>` and `</think>` as tokens."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import httpx
import openai
import pytest

from minibatch.daemon.generation.answer import AnswerStream, split_answer
from minibatch.daemon.generation.reasoning import ReasoningSplitter, Thinking, split_reasoning
from minibatch.engine.text.tokenizer import TextTokenizer
from tests.conftest import TINY_COMMON, TOKENIZER_FILES

from .helpers import Daemon, session

TAGS = ("<think>", "</think>")
THINKING_TEMPLATE = """{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.role == 'assistant' and m.reasoning_content %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""


def test_the_splitter_streams_reasoning_then_the_answer():
    assert split_reasoning("<think>\nhmm, 2+2\n</think>\n\nIt is 4.", TAGS) == ("hmm, 2+2\n", "It is 4.")
    assert split_reasoning("hmm</think>4", TAGS, inside=True) == ("hmm", "4")  # the prompt opened it
    assert split_reasoning("Just 4.", TAGS) == ("", "Just 4.")  # no thinking: all answer
    assert split_reasoning("<think>never closed", TAGS) == ("never closed", "")
    # tags cut anywhere across deltas: nothing of them leaks, nothing is lost
    text = "<think>\nstep one, step two\n</think>\n\nThe answer."
    for cut in range(1, len(text)):
        s = ReasoningSplitter(TAGS)
        parts = [s.push(text[:cut]), s.push(text[cut:]), s.finish()]
        assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == (
            "step one, step two\n",
            "The answer.",
        ), cut


def test_an_answer_splits_the_same_whole_and_streamed():
    """Thoughts, text and a tool call: every API face gets these parts from daemon/answer.py, whatever
    the deltas' cuts."""
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    text = f"<think>\nadd them\n</think>\n\nLet me add. {call}"
    thinking = Thinking(TAGS, inside=False)
    whole = split_answer(text, thinking, tools=True)
    assert whole.thought == "add them\n" and whole.text == "Let me add." and len(whole.calls) == 1
    assert whole.calls[0]["function"]["name"] == "add"
    for cut in range(1, len(text)):
        stream = AnswerStream(thinking, tools=True)
        parts = [stream.push(text[:cut]), stream.push(text[cut:], finished=True)]
        assert "".join(p.thought for p in parts) == whole.thought == stream.thought, cut
        assert "".join(p.text for p in parts).strip() == whole.text, cut
        assert parts[0].calls == [] and [c["function"] for c in parts[1].calls] == [whole.calls[0]["function"]]
    plain = split_answer("no thinking, no tools", None, tools=False)
    assert plain == ("", "no thinking, no tools", [])


@pytest.fixture(scope="module")
def thinking_model_dir(tmp_path_factory, builtin_model_dir) -> Path:
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer

    path = tmp_path_factory.mktemp("tiny-thinking")
    for name in TOKENIZER_FILES:
        if (builtin_model_dir / name).exists():
            shutil.copy(builtin_model_dir / name, path / name)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok.save(str(path / "tokenizer.json"))
    (path / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    torch.manual_seed(5)
    cfg = transformers.LlamaConfig(
        **{**TINY_COMMON, "vocab_size": tok.get_vocab_size(), "max_position_embeddings": 1024},
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def daemon(thinking_model_dir):
    d = tempfile.mkdtemp(prefix="mbth-", dir="/tmp")
    daemon = Daemon(Path(d) / "d.sock", thinking_model_dir, "--kv-cache-gb", "0.05").wait_ready()
    yield daemon
    assert daemon.stop() == 0, daemon.log_text()
    shutil.rmtree(d, ignore_errors=True)


def sdk(daemon) -> openai.OpenAI:
    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.socket)), timeout=120)
    return openai.OpenAI(base_url="http://localhost/v1", api_key="unused", max_retries=0, http_client=http)


ASK = [{"role": "user", "content": "What is 2+2?"}]
# (seeded sampling: the tiny random model's greedy output is only newlines; a seed makes any draw repeatable)


def test_the_template_is_detected_as_thinking(thinking_model_dir, builtin_model_dir):
    tok = TextTokenizer(thinking_model_dir)
    assert tok.reasoning_tags == TAGS and tok.can_stop_thinking
    assert tok.thinks_from_prompt(ASK) and not tok.thinks_from_prompt(ASK, enable_thinking=False)
    assert TextTokenizer(builtin_model_dir).reasoning_tags is None  # SmolLM2's template does not think


def test_reasoning_content_whole_streamed_and_left_in_with_none(daemon):
    client = sdk(daemon)
    r = client.chat.completions.create(model="default", messages=ASK, max_tokens=12, temperature=1.0, seed=7)
    message = r.choices[0].message
    thought = message.model_extra["reasoning_content"]
    # the prompt opened the thinking and the random model never closes it: everything is reasoning
    assert thought and message.content == "" and "<think>" not in thought
    assert 0 < r.usage.completion_tokens_details.reasoning_tokens <= 14
    chunks = list(
        client.chat.completions.create(
            model="default", messages=ASK, max_tokens=12, temperature=1.0, seed=7, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == ""
    plain = client.chat.completions.create(
        model="default", messages=ASK, max_tokens=12, temperature=1.0, seed=7, extra_body={"reasoning_format": "none"}
    )
    assert plain.choices[0].message.content.strip() == thought.strip()
    assert "reasoning_content" not in (plain.choices[0].message.model_extra or {})


def test_ollama_think_both_ways(daemon):
    import asyncio

    async def go():
        async with session(daemon.socket) as s:
            out = {}
            for think in (True, False):
                body = {
                    "messages": ASK,
                    "think": think,
                    "stream": False,
                    "options": {"temperature": 1.0, "seed": 7, "num_predict": 8},
                }
                async with s.post("/api/chat", json=body) as r:
                    out[think] = await r.json()
            body = {"messages": ASK, "think": True, "options": {"temperature": 1.0, "seed": 7, "num_predict": 8}}
            async with s.post("/api/chat", json=body) as r:
                out["stream"] = [json.loads(line) for line in (await r.text()).splitlines() if line]
            return out

    out = asyncio.run(go())
    thinking = out[True]["message"]["thinking"]
    assert thinking and out[True]["message"]["content"] == ""
    # think false: the template's switch renders a prompt whose thinking is already closed; all answer
    assert "thinking" not in out[False]["message"] and out[False]["message"]["content"]
    assert out[False]["prompt_eval_count"] > out[True]["prompt_eval_count"]
    streamed = "".join(line["message"].get("thinking", "") for line in out["stream"] if "message" in line)
    assert streamed == thinking


def test_anthropic_thinking_blocks(daemon):
    anthropic = pytest.importorskip("anthropic")
    httpx2 = pytest.importorskip("httpx2")
    http = httpx2.Client(transport=httpx2.HTTPTransport(uds=str(daemon.socket)), timeout=120)
    client = anthropic.Anthropic(base_url="http://localhost", api_key="unused", max_retries=0, http_client=http)
    sampled = {"temperature": 1.0}
    r = client.messages.create(
        model="default",
        max_tokens=10,
        messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 8},  # less than max_tokens, as Anthropic requires
        extra_body=sampled,
    )
    assert [b.type for b in r.content][:1] == ["thinking"] and r.content[0].thinking
    off = client.messages.create(model="default", max_tokens=10, messages=ASK, extra_body=sampled)
    assert [b.type for b in off.content] == ["text"]  # no thinking asked: the template's switch turns it off
    assert (
        off.usage.input_tokens + off.usage.cache_read_input_tokens
        > r.usage.input_tokens + r.usage.cache_read_input_tokens
    )
    with client.messages.stream(
        model="default",
        max_tokens=10,
        messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 8},  # less than max_tokens, as Anthropic requires
        extra_body=sampled,
    ) as s:
        events = list(s)
        final = s.get_final_message()
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "thinking_delta" in deltas and final.content[0].type == "thinking" and final.content[0].thinking


FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


def test_a_budget_closes_the_thinking_and_the_schema_constrains_the_answer(daemon):
    client = sdk(daemon)
    fmt = {"type": "json_schema", "json_schema": {"name": "flag", "schema": FLAG}}
    out = {}
    for budget in (2, 6):
        r = client.chat.completions.create(
            model="default",
            messages=ASK,
            max_tokens=40,
            temperature=1.0,
            seed=7,
            response_format=fmt,
            logprobs=True,
            extra_body={"max_reasoning_tokens": budget},
        )
        message = r.choices[0].message
        tokens = [t.token for t in r.choices[0].logprobs.content]
        assert tokens.index("</think>") == budget, tokens  # exactly `budget` thoughts, then the forced close
        # the random model never closes its thinking: the budget did, and the answer is the schema's JSON
        assert json.loads(message.content) in ({"ok": True}, {"ok": False}), message.content
        assert r.choices[0].finish_reason == "stop"
        out[budget] = message.model_extra["reasoning_content"]
    assert out[2] and out[6].startswith(out[2]) and len(out[6]) > len(out[2])  # the same draw, cut sooner
    # without a budget the schema still waits for the thinking to end: here it never does
    r = client.chat.completions.create(
        model="default", messages=ASK, max_tokens=12, temperature=1.0, seed=7, response_format=fmt
    )
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content == ""
    # with the reasoning left in the content the grammar constrains the whole output, as for any model
    r = client.chat.completions.create(
        model="default",
        messages=ASK,
        max_tokens=40,
        temperature=1.0,
        seed=7,
        response_format=fmt,
        extra_body={"reasoning_format": "none"},
    )
    assert json.loads(r.choices[0].message.content) in ({"ok": True}, {"ok": False})
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.socket))) as http:
        bad = http.post("http://localhost/v1/chat/completions", json={"messages": ASK, "max_reasoning_tokens": -1})
    assert bad.status_code == 400 and "max_reasoning_tokens" in bad.json()["error"]["message"]


def test_anthropic_budget_tokens_bounds_the_thinking(daemon):
    import asyncio

    body = {
        "model": "default",
        "max_tokens": 40,
        "messages": ASK,
        "temperature": 1.0,
        "thinking": {"type": "enabled", "budget_tokens": 3},
        "output_config": {"format": {"type": "json_schema", "schema": FLAG}},
    }

    async def go():
        async with session(daemon.socket) as s:
            async with s.post("/v1/messages", json=body) as r:
                return r.status, await r.json()

    status, r = asyncio.run(go())
    assert status == 200, r
    assert [b["type"] for b in r["content"]] == ["thinking", "text"] and r["content"][0]["thinking"]
    assert json.loads(r["content"][1]["text"]) in ({"ok": True}, {"ok": False}) and r["stop_reason"] == "end_turn"


def test_responses_reasoning_items_whole_and_streamed(daemon):
    client = sdk(daemon)
    fmt = {"format": {"type": "json_schema", "name": "flag", "schema": FLAG}}
    r = client.responses.create(model="default", input="What is 2+2?", max_output_tokens=10, temperature=1.0)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    thought = r.output[0].content[0].text
    assert thought and r.output[1].content[0].text == "" and r.usage.output_tokens_details.reasoning_tokens > 0
    events = list(
        client.responses.create(
            model="default", input="What is 2+2?", max_output_tokens=10, temperature=1.0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_item.done")
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    final = events[-1].response
    assert final.output[0].type == "reasoning" and final.output[0].content[0].text == streamed and streamed
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]
    # a format constrains the answer after the thoughts, which this model never closes: no answer yet
    r = client.responses.create(model="default", input="What is 2+2?", max_output_tokens=8, temperature=1.0, text=fmt)
    assert r.status == "incomplete" and r.output[0].type == "reasoning"


def test_levels_and_switches_map_to_one_reasoning():
    """What each API names, as the pipeline's one Reasoning: a level is its budget (EFFORT_BUDGETS) unless a
    budget is given, "none" and enable_thinking false are off, a switch the daemon hands the template itself
    is refused by name."""
    from minibatch.daemon.generation.reasoning import EFFORT_BUDGETS
    from minibatch.daemon.generation.spec import Reasoning
    from minibatch.daemon.protocol import ApiError

    assert Reasoning.asked("low").budget == EFFORT_BUDGETS["low"] == 1024 and not Reasoning.asked("low").off
    assert Reasoning.asked("low", budget=7).budget == 7 and Reasoning.asked("high").budget is None
    assert Reasoning.asked("none").off and Reasoning.asked("none").budget == 0
    off = Reasoning.asked(template_args={"enable_thinking": False, "custom": 1})
    assert off.off and off.template_args == {"enable_thinking": False, "custom": 1}
    for args, param in (({"messages": []}, "chat_template_kwargs.messages"), ({"enable_thinking": "no"}, None)):
        with pytest.raises(ApiError) as e:
            Reasoning.asked(template_args=args)
        assert e.value.param == (param or "chat_template_kwargs.enable_thinking")


def test_effort_none_and_the_template_switch_think_not(daemon):
    client = sdk(daemon)
    plain = client.chat.completions.create(
        model="default", messages=ASK, max_tokens=4, temperature=1.0, seed=7, extra_body={"reasoning_effort": "none"}
    )
    switched = client.chat.completions.create(
        model="default",
        messages=ASK,
        max_tokens=4,
        temperature=1.0,
        seed=7,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    thinking = client.chat.completions.create(model="default", messages=ASK, max_tokens=4, temperature=1.0, seed=7)
    # the prompt without the thinking opened (the template's switch): other tokens, no reasoning_content
    assert plain.usage.prompt_tokens == switched.usage.prompt_tokens != thinking.usage.prompt_tokens
    assert plain.choices[0].message.content == switched.choices[0].message.content
    assert not (plain.choices[0].message.model_extra or {}).get("reasoning_content")
    # (bounded: a random model's thought under "low" would run to its budget of 1,024 and then the context, past
    # httpx's default timeout of 5 s on a loaded machine)
    short = {"num_predict": 4}
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.socket)), timeout=120) as http:
        bad = http.post(
            "http://localhost/v1/chat/completions", json={"messages": ASK, "chat_template_kwargs": {"tools": []}}
        )
        level = http.post(
            "http://localhost/api/chat", json={"messages": ASK, "think": "low", "stream": False, "options": short}
        )
        wrong = http.post(
            "http://localhost/api/chat", json={"messages": ASK, "think": "max", "stream": False, "options": short}
        )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs.tools"
    assert level.status_code == 200 and wrong.status_code == 400 and "think" in wrong.json()["error"]


def test_the_daemons_reasoning_budget_bounds_a_request_without_one(thinking_model_dir):
    """--reasoning-budget 3: three thoughts, then the close, unless the request sets its own."""
    d = tempfile.mkdtemp(prefix="mbrb-", dir="/tmp")
    daemon = Daemon(Path(d) / "d.sock", thinking_model_dir, "--kv-cache-gb", "0.05", "--reasoning-budget", "3")
    try:
        daemon.wait_ready()
        client = sdk(daemon)
        for extra, want in (({}, 3), ({"max_reasoning_tokens": 5}, 5)):
            r = client.chat.completions.create(
                model="default", messages=ASK, max_tokens=12, temperature=1.0, seed=7, logprobs=True, extra_body=extra
            )
            tokens = [t.token for t in r.choices[0].logprobs.content]
            assert tokens.index("</think>") == want, tokens
            assert r.usage.completion_tokens_details.reasoning_tokens > 0
    finally:
        assert daemon.stop() == 0, daemon.log_text()
        shutil.rmtree(d, ignore_errors=True)

"""n > 1 through the real daemon and the openai SDK: n choices, each streamed by index, usage over all of them."""

from __future__ import annotations

import pytest

from .helpers import running_daemon

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

EXACT = {"ignore_eos": True}  # every completion runs to max_tokens
MESSAGES = [{"role": "user", "content": "Tell me something about the sea, at length, with details."}]


@pytest.fixture(scope="module")
def daemon(tiny_chat_model_dir):
    with running_daemon(tiny_chat_model_dir, "--max-num-seqs", "8", "--kv-cache-gb", "0.05", prefix="mbn-") as daemon:
        yield daemon


def sdk(daemon) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://localhost/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.socket)), timeout=120),
    )


@pytest.mark.parametrize("mode", ["continuous", "static"])
def test_n_choices_whole_and_streamed(daemon, mode):
    from minibatch.daemon.client import request_json

    assert request_json(str(daemon.socket), "PUT", "/v1/engine/mode", {"mode": mode})[0] in (200, 202)
    client = sdk(daemon)
    r = client.chat.completions.create(
        model="default", messages=MESSAGES, n=3, temperature=1.0, seed=11, max_tokens=12, extra_body=EXACT
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1  # each completion draws with its own seed (seed + index)
    assert r.usage.completion_tokens == 36  # all three counted, the prompt once
    again = client.chat.completions.create(
        model="default", messages=MESSAGES, n=3, temperature=1.0, seed=11, max_tokens=12, extra_body=EXACT
    )
    assert [c.message.content for c in again.choices] == texts  # reproducible
    greedy = client.chat.completions.create(
        model="default", messages=MESSAGES, n=2, temperature=0, max_tokens=12, extra_body=EXACT
    )
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    prompt_tokens = greedy.usage.prompt_tokens
    assert greedy.usage.completion_tokens == 24 and greedy.usage.total_tokens == prompt_tokens + 24

    chunks = list(
        client.chat.completions.create(
            model="default",
            messages=MESSAGES,
            n=3,
            temperature=1.0,
            seed=11,
            max_tokens=12,
            extra_body=EXACT,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = {
        i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        for i in range(3)
    }
    assert [streamed[i] for i in range(3)] == texts
    finishes = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finishes == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == 36 and chunks[-1].usage.prompt_tokens == prompt_tokens

    legacy = client.completions.create(
        model="default", prompt="Once upon a time", n=2, temperature=0, max_tokens=5, extra_body=EXACT
    )
    assert [c.index for c in legacy.choices] == [0, 1] and legacy.choices[0].text == legacy.choices[1].text
    assert daemon.wait_idle()["kv_blocks_used"] == 0


def test_n_beyond_the_cap_is_a_400_naming_n(daemon):
    with pytest.raises(openai.BadRequestError) as err:
        sdk(daemon).chat.completions.create(model="default", messages=MESSAGES, n=9, max_tokens=4)
    assert err.value.body["param"] == "n" and "8" in err.value.body["message"]

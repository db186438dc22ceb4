"""Batch prompts on /v1/completions and logit_bias, through the real daemon and the openai SDK."""

from __future__ import annotations

import pytest

from .helpers import running_daemon

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

EXACT = {"ignore_eos": True}


@pytest.fixture(scope="module")
def daemon(tiny_chat_model_dir):
    with running_daemon(
        tiny_chat_model_dir, "--max-num-seqs", "4", "--max-queue", "2", "--kv-cache-gb", "0.05", prefix="mbb-"
    ) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def client(daemon) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://localhost/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.socket)), timeout=120),
    )


def one(client, prompt, **kw) -> str:
    return client.completions.create(model="default", prompt=prompt, temperature=0, **kw).choices[0].text


@pytest.mark.parametrize("kind", ["texts", "token lists"])
def test_batch_prompt_choices_are_the_single_answers_in_order(daemon, client, kind):
    prompts = ["The sea is", "Once upon a time", "Numbers: 1, 2,"]
    if kind == "token lists":
        prompts = [[5 + i, 17, 30 + 3 * i, 8] for i in range(3)]
    alone = [one(client, p, max_tokens=6, extra_body=EXACT) for p in prompts]
    r = client.completions.create(model="default", prompt=prompts, temperature=0, max_tokens=6, n=2, extra_body=EXACT)
    assert [c.index for c in r.choices] == list(range(6))  # prompt_index * n + i
    assert [c.text for c in r.choices] == [t for t in alone for _ in range(2)]
    assert r.usage.completion_tokens == 36
    each = [client.completions.create(model="default", prompt=p, max_tokens=1).usage.prompt_tokens for p in prompts]
    assert r.usage.prompt_tokens == sum(each)  # every prompt counted once, whatever n
    assert daemon.wait_idle()["kv_blocks_used"] == 0


def test_batch_prompt_streams_every_choice_by_index(daemon, client):
    prompts = ["The sea is", "Once upon a time"]
    alone = [one(client, p, max_tokens=5, extra_body=EXACT) for p in prompts]
    text = {}
    finish = {}
    for chunk in client.completions.create(
        model="default", prompt=prompts, temperature=0, max_tokens=5, stream=True, extra_body=EXACT
    ):
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert text == {0: alone[0], 1: alone[1]} and finish == {0: "length", 1: "length"}


@pytest.mark.parametrize(
    "prompt, param, message",
    [
        (["fine", 5], "prompt.1", "a batch of texts holds texts only"),
        ([[5, 6], [7, -1, 8]], "prompt.1.1", "prompt.1.1: token id -1 is out of range [0, "),
        ([[5, 6], [7, 8, 10**9]], "prompt.1.2", "token id 1000000000 is out of range"),
        ([5, -1], "prompt.1", "prompt.1: token id -1 is out of range [0, "),
        ([[5, 6], []], "prompt.1", "prompt.1: the prompt is empty"),
        (5, "prompt", "must be a string, a list of token ids"),
        (["x"] * 65, "prompt", "at most 64 prompts"),
    ],
)
def test_batch_prompt_errors_name_the_element(daemon, client, prompt, param, message):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="default", prompt=prompt, max_tokens=3)
    body = err.value.body
    assert body["param"] == param and message in body["message"], body
    assert daemon.wait_idle()["kv_blocks_used"] == 0  # nothing admitted: all or none


def test_batch_prompt_is_all_or_none_at_the_queue_cap(daemon, client):
    # 4 running + 2 waiting at most: a batch of 4 prompts x n=2 cannot all be admitted.
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="default", prompt=["a", "b", "c", "d"], n=2, max_tokens=3)
    stats = daemon.wait_idle()
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0 and stats["waiting"] == 0


def test_logit_bias_forces_and_bans_tokens(daemon, client):
    messages = [{"role": "user", "content": "Say something."}]

    def chat(bias, **kw) -> str:
        kw = {"temperature": 0, **kw}
        r = client.chat.completions.create(
            model="default", messages=messages, max_tokens=4, logit_bias=bias, extra_body=EXACT, **kw
        )
        return r.choices[0].message.content

    text = {t: chat({str(t): 100}) for t in (42, 43)}  # +100 makes a token win every step
    assert text[42] != text[43] and all(len(v) > 0 for v in text.values())
    assert text[42][: len(text[42]) // 4] * 4 == text[42]  # the same token four times
    both = chat({"42": 100, "43": 100})  # both lifted: the model's own preference decides
    winner, other = (42, 43) if both == text[42] else (43, 42)
    assert both == text[winner]
    assert chat({str(winner): -100, str(other): 100}) == text[other]  # -100 bans the one it would pick
    assert chat({"42": 100}, temperature=1.0, seed=3) == text[42]  # and a draw follows the bias too
    assert chat(None) not in (text[42], text[43])  # without a bias, neither


@pytest.mark.parametrize(
    "bias, param, message",
    [
        ({"abc": 1}, "logit_bias.abc.[key]", "should match pattern"),
        ({"5": 101}, "logit_bias.5", "less than or equal to 100"),
        ({"5": -100.5}, "logit_bias.5", "greater than or equal to -100"),
        ({str(i): 1 for i in range(301)}, "logit_bias", "at most 300"),
        ({"999999999": 1}, "logit_bias.999999999", "token id 999999999 is out of range [0, "),
    ],
)
def test_logit_bias_errors_name_the_entry(daemon, client, bias, param, message):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=2, logit_bias=bias
        )
    body = err.value.body
    assert body["param"] == param and message in body["message"], body

"""Checks 1-3 and 8: hostile and out-of-range input gets a clear 4xx, never a 5xx, never a prefill."""

from __future__ import annotations

import json
import re
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minibatch.daemon.client import request_json

from .conftest import assert_clean

FIELDS = [
    "model",
    "messages",
    "stream",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "n",
    "stream_options",
    "ignore_eos",
    "stop_token_ids",
]
json_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
json_value = st.recursive(
    json_scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3), max_leaves=6
)
ROLES = ["system", "user", "assistant"]
JSON_TYPES = ("string", "number", "integer", "boolean", "array", "object", "null")
# Every one of these is an invalid message (an empty string content is valid, as in the OpenAI API, so it is not here).
hostile_message = st.one_of(
    st.just({}),
    st.just({"role": "user"}),
    st.just({"content": "hi"}),
    st.just({"role": "user", "content": None}),
    st.fixed_dictionaries({"role": st.text(max_size=8).filter(lambda r: r not in ROLES), "content": json_value}),
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(ROLES),
            "content": st.one_of(
                st.booleans(),
                st.integers(),
                st.floats(),
                st.lists(json_scalar, min_size=1, max_size=3),
                st.dictionaries(st.text(max_size=8), json_scalar, max_size=3),
            ),
        }
    ),
)
# At least one violation per body, so every body is truly invalid; the rest is random junk around it.
violation = st.one_of(
    st.tuples(
        st.text(min_size=1, max_size=10).filter(
            lambda k: (
                k
                not in FIELDS
                + [
                    "user",
                    "logprobs",
                    "max_completion_tokens",
                    "messages",
                    "top_logprobs",
                    "response_format",
                    "tools",
                    "tool_choice",
                    "parallel_tool_calls",
                ]
            )
        ),
        json_value,
    ),
    st.tuples(
        st.just("messages"), st.one_of(st.just([]), st.lists(hostile_message, min_size=1, max_size=3), json_scalar)
    ),
    st.tuples(
        st.sampled_from(["temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p"]),
        st.one_of(
            st.floats(min_value=2.0001, max_value=1e308),
            st.floats(max_value=-2.0001, min_value=-1e308),
            st.just(float("nan")),
            st.just(float("inf")),
            st.text(max_size=5),
            st.booleans(),
        ),
    ),
    st.tuples(
        st.sampled_from(["max_tokens", "top_k", "seed", "n"]),
        st.one_of(
            st.integers(max_value=-2),
            st.integers(min_value=2**64),
            # a float with a fraction (or NaN, inf); 5.0 is an integer as JSON Schema counts (protocol.Int)
            st.floats().filter(lambda f: not f.is_integer()),
            st.text(max_size=5),
            st.booleans(),
        ),
    ),
    st.tuples(st.sampled_from(["stream", "ignore_eos"]), st.one_of(st.integers(), st.text(max_size=5), st.none())),
    st.tuples(
        st.just("stop"),
        st.one_of(
            st.just(""),
            st.lists(st.just(""), min_size=1, max_size=2),
            st.integers(),
            st.lists(st.integers(), min_size=1, max_size=2),
        ),
    ),
    st.tuples(
        st.just("top_logprobs"), st.one_of(st.integers(min_value=21), st.integers(max_value=-1), st.text(max_size=3))
    ),
    st.tuples(
        st.just("messages"),
        st.builds(
            lambda text, at: [{"role": "user", "content": text[:at] + "\ud800" + text[at:]}],
            st.text(max_size=10),
            st.integers(0, 10),
        ),
    ),
    st.tuples(
        st.just("tools"),
        st.one_of(
            json_scalar.filter(lambda v: v is not None),
            st.lists(json_scalar, min_size=1, max_size=2),
            st.builds(
                lambda name: [{"type": "function", "function": {"name": name}}],
                st.text(max_size=70).filter(lambda n: not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", n)),
            ),
            st.builds(
                lambda p: [{"type": "function", "function": {"name": "f", "parameters": p}}],
                st.one_of(json_scalar, st.lists(json_value, max_size=2)),
            ),
            st.just([{"type": "function", "function": {"name": "f"}}] * 129),
        ),
    ),
    st.tuples(
        st.just("tool_choice"),
        st.one_of(
            st.text(max_size=10).filter(lambda t: t not in ("none", "auto", "required")),
            st.integers(),
            st.booleans(),
            st.just({"type": "function"}),
            st.just({"type": "function", "function": {}}),
        ),
    ),
    st.tuples(
        st.just("response_format"),
        st.one_of(
            json_scalar.filter(lambda v: v is not None),
            st.lists(json_scalar, max_size=2),
            st.fixed_dictionaries(
                {"type": st.text(max_size=12).filter(lambda t: t not in ("text", "json_object", "json_schema"))}
            ),
            st.just({"type": "json_schema"}),
            st.fixed_dictionaries(
                {
                    "type": st.just("json_schema"),
                    "json_schema": st.fixed_dictionaries(
                        {
                            "name": st.text(min_size=1, max_size=8),
                            "schema": st.one_of(
                                json_scalar,
                                st.lists(json_value, max_size=2),
                                st.fixed_dictionaries(
                                    {"type": st.text(max_size=10).filter(lambda t: t not in JSON_TYPES)}
                                ),
                            ),
                        }
                    ),
                }
            ),
        ),
    ),
)
hostile_object = st.builds(
    lambda junk, bad: {**junk, bad[0]: bad[1]},
    st.dictionaries(st.sampled_from(FIELDS), json_value, max_size=4).map(
        lambda d: {"messages": [{"role": "user", "content": "hi"}], **d}
    ),
    violation,
)


def _raw_post(sock_path, payload: bytes, path: bytes = b"/v1/chat/completions") -> tuple[int, dict]:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(30)
    s.connect(str(sock_path))
    s.sendall(
        b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(payload) + payload
    )
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _check_error(status, body, expect_param: bool):
    assert 400 <= status < 500, (status, body)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    if expect_param:
        assert body["error"]["param"], body


@settings(
    max_examples=700, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(body=hostile_object)
def test_check1_hostile_json_objects_get_4xx_naming_the_field(tiny_daemon, body):
    payload = json.dumps(body, allow_nan=True).encode()
    status, err = _raw_post(tiny_daemon.socket, payload)
    # JSON-level NaN/Infinity is refused before fields are read; everything else names its field
    nan = b"NaN" in payload or b"Infinity" in payload
    _check_error(status, err, expect_param=not nan)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    payload=st.one_of(
        st.binary(max_size=200),
        st.text(max_size=100).map(str.encode),
        st.sampled_from([b"", b"[]", b"null", b"1e999", b'{"messages": [', b'"str"', b"{" * 5000 + b"}" * 5000]),
    )
)
def test_check1_random_bytes_and_invalid_json_get_4xx(tiny_daemon, payload):
    status, err = _raw_post(tiny_daemon.socket, payload)
    _check_error(status, err, expect_param=False)


ollama_violation = st.one_of(
    st.tuples(
        st.just("messages"),
        st.one_of(  # (no messages at all is Ollama's load request: valid)
            json_scalar,
            st.lists(
                st.one_of(
                    json_scalar, st.just({"role": "robot", "content": "x"}), st.just({"role": "user", "content": 5})
                ),
                min_size=1,
                max_size=2,
            ),
        ),
    ),
    st.tuples(
        st.just("options"),
        st.one_of(
            st.fixed_dictionaries(
                {"temperature": st.one_of(st.floats(min_value=2.0001, max_value=1e300), st.text(max_size=3))}
            ),
            st.fixed_dictionaries({"num_predict": st.one_of(st.integers(max_value=-3), st.text(max_size=3))}),
            st.fixed_dictionaries({"top_p": st.one_of(st.floats(max_value=0), st.booleans())}),
            st.fixed_dictionaries({"stop": st.one_of(st.integers(), st.just([""]))}),
            json_scalar,
        ),
    ),
    st.tuples(
        st.just("format"),
        st.one_of(
            st.text(max_size=8).filter(lambda t: t not in ("json", "")),
            st.integers(),
            st.lists(json_scalar, min_size=1, max_size=2),
            st.fixed_dictionaries({"type": st.text(max_size=10).filter(lambda t: t not in JSON_TYPES)}),
        ),
    ),
    st.tuples(st.just("stream"), st.one_of(st.integers(), st.text(max_size=3))),
    st.tuples(
        st.just("keep_alive"),
        st.one_of(
            st.booleans(),
            st.lists(st.integers(), max_size=2),
            st.sampled_from(["5 minutes", "m5", "1e999", "--1", "forever", "5mm", "inf"]),
        ),
    ),
)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(junk=st.dictionaries(st.text(max_size=8), json_value, max_size=3), bad=ollama_violation, chat=st.booleans())
def test_check1_ollama_shaped_garbage_gets_4xx_in_ollamas_shape(tiny_daemon, junk, bad, chat):
    model = tiny_daemon.get("/v1/models")[1]["data"][0]["id"]  # the right model: refused for the garbage alone
    body = {
        **junk,
        "model": model,
        ("messages" if chat else "prompt"): [{"role": "user", "content": "hi"}] if chat else "hi",
    }
    body[bad[0]] = bad[1]
    if not chat and bad[0] == "messages":  # the same garbage where generate reads its text, unless it is text
        body["prompt"] = bad[1] if not isinstance(bad[1], str) else 5
    status, err = _raw_post(tiny_daemon.socket, json.dumps(body).encode(), b"/api/chat" if chat else b"/api/generate")
    assert 400 <= status < 500, (status, err, body)
    assert set(err) == {"error"} and isinstance(err["error"], str) and err["error"], err


def test_check1_daemon_is_clean_after_the_storm(tiny_daemon):
    assert_clean(tiny_daemon)


def test_check2_context_boundary(tiny_daemon):
    limit = tiny_daemon.get("/health")[1]["max_model_len"]
    steps_before = len(tiny_daemon.get("/v1/engine/stats?steps=600")[1]["recent_steps"])
    prompt = [100 + i % 500 for i in range(limit - 24)]
    status, body = request_json(
        str(tiny_daemon.socket),
        "POST",
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 25, "ignore_eos": True},
        timeout=30,
    )
    assert status == 400 and body["error"]["param"] == "max_tokens"
    assert f"({limit - 24} tokens)" in body["error"]["message"] and "max_tokens (25)" in body["error"]["message"]
    assert f"limit of {limit} tokens" in body["error"]["message"]
    assert len(tiny_daemon.get("/v1/engine/stats?steps=600")[1]["recent_steps"]) == steps_before  # no prefill ran
    status, body = request_json(
        str(tiny_daemon.socket),
        "POST",
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 24, "ignore_eos": True},
        timeout=60,
    )
    assert status == 200 and body["usage"]["completion_tokens"] == 24 and body["usage"]["total_tokens"] == limit
    assert_clean(tiny_daemon)


@pytest.mark.parametrize(
    "field,value,limit",
    [
        ("temperature", -0.1, "greater than or equal to 0"),
        ("top_p", 0, "greater than 0"),
        ("top_p", 1.5, "less than or equal to 1"),
        ("top_k", -2, "greater than or equal to -1"),
        ("max_tokens", 0, "greater than or equal to 1"),
        ("max_tokens", -5, "greater than or equal to 1"),
        ("presence_penalty", -2.1, "greater than or equal to -2"),
        ("frequency_penalty", 2.1, "less than or equal to 2"),
        ("repetition_penalty", 0, "greater than 0"),
        ("min_p", 1.5, "less than or equal to 1"),
        ("seed", -1, "greater than or equal to 0"),
    ],
)
def test_check3_sampling_out_of_range(tiny_daemon, field, value, limit):
    status, body = request_json(
        str(tiny_daemon.socket),
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], field: value},
    )
    assert status == 400 and body["error"]["param"] == field and limit in body["error"]["message"], body


def test_check8_request_that_can_never_fit_is_rejected_up_front(tiny_chat_model_dir, short_tmp):
    from tests.daemon.helpers import Daemon

    # 8 KV blocks of 16 tokens: 128 tokens in the whole pool, far below the 1024-token context
    d = Daemon(short_tmp / "d.sock", tiny_chat_model_dir, "--kv-cache-gb", "0.0001", "--max-num-seqs", "1").wait_ready()
    try:
        total = d.stats()["kv_blocks_total"]
        status, body = request_json(
            str(d.socket),
            "POST",
            "/v1/completions",
            {"prompt": list(range(100, 200)), "max_tokens": total * 16},
            timeout=10,
        )
        assert (
            status == 400
            and "could never run" in body["error"]["message"]
            and f"cache has {total}" in body["error"]["message"]
        )
        status, body = request_json(
            str(d.socket), "POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4}, timeout=30
        )
        assert status == 200
    finally:
        d.stop()

"""Keys with names, and stored responses that belong to the key that made them: another key gets the answer an
unknown id gets, whether it reads, continues or deletes; what is stored is bounded and never changed by a
continuation; the engine endpoints never show a response's id."""

from __future__ import annotations

import json
import urllib.request

import pytest

from minibatch.daemon.api.response_store import ResponseStore
from minibatch.daemon.api.responses_bodies import METADATA_KEY, METADATA_VALUE
from minibatch.daemon.guard import Guard, GuardError, key_name, parse_key
from minibatch.daemon.protocol import ApiError

from .helpers import keyed_daemon

ALICE, BOB = "alice-secret-0001", "bob-secret-00002"


def call(daemon, method: str, path: str, key: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(
        daemon.url + path,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_keys_have_names():
    assert parse_key(f"alice={ALICE}", "--api-key") == ("alice", ALICE)
    assert parse_key("abcdefgh12==", "--api-key") == (key_name("abcdefgh12=="), "abcdefgh12==")  # base64 padding
    g = Guard.from_options(api_key=f"alice={ALICE},bob={BOB}", host="127.0.0.1", port=1)
    assert g.api_keys == (ALICE, BOB) and g.key_names == {ALICE: "alice", BOB: "bob"}
    with pytest.raises(GuardError, match="given to two different keys"):
        Guard.from_options(api_key=f"alice={ALICE},alice={BOB}", host="127.0.0.1", port=1)
    with pytest.raises(GuardError, match="socket's own user"):
        Guard.from_options(api_key=f"local={ALICE}", host="127.0.0.1", port=1)


def test_the_store_is_bounded_by_bytes_and_copies_what_it_gives():
    store = ResponseStore(max_items=100, max_bytes=10_000)
    ids = [f"resp_{i:024x}" for i in range(20)]
    for rid in ids:
        store.put({"id": rid, "text": "x" * 1000}, [{"role": "user", "content": "hi"}], "alice")
    assert store.bytes <= 10_000 and store.evicted > 0
    with pytest.raises(ApiError):
        store.get(ids[0], "alice")  # the oldest went first
    _, conv = store.get(ids[-1], "alice")
    conv.append({"role": "assistant"})
    assert len(store.get(ids[-1], "alice")[1]) == 1  # what it gave was a copy
    with pytest.raises(ApiError) as other:
        store.get(ids[-1], "bob")
    with pytest.raises(ApiError) as unknown:
        store.get(f"resp_{'f' * 24}", "bob")
    assert other.value.status == unknown.value.status == 404 and other.value.code == unknown.value.code
    assert other.value.message.replace(ids[-1], "ID") == unknown.value.message.replace(f"resp_{'f' * 24}", "ID")


@pytest.fixture(scope="module")
def daemon(tiny_chat_model_dir):
    with keyed_daemon(tiny_chat_model_dir, f"alice={ALICE},bob={BOB}") as d:
        yield d


def test_a_stored_response_is_its_keys_alone(daemon):
    status, made = call(daemon, "POST", "/v1/responses", ALICE, {"input": "hi", "max_output_tokens": 3})
    assert status == 200, made
    rid = made["id"]
    unknown = "resp_" + "0" * 24

    def same_as_unknown(status, body, known_status, known_body):
        assert (
            (status, body["error"]["code"])
            == (known_status, known_body["error"]["code"])
            == (404, "response_not_found")
        )
        assert body["error"]["message"].replace(rid, "ID") == known_body["error"]["message"].replace(unknown, "ID")

    for method, path, body in [
        ("GET", "/v1/responses/{}", None),
        ("DELETE", "/v1/responses/{}", None),
        ("POST", "/v1/responses", {"input": "more", "max_output_tokens": 2, "previous_response_id": "{}"}),
    ]:
        fill = lambda x, v: json.loads(json.dumps(x).replace("{}", v)) if x else None  # noqa: E731
        got = call(daemon, method, path.format(rid), BOB, fill(body, rid))
        want = call(daemon, method, path.format(unknown), BOB, fill(body, unknown))
        same_as_unknown(*got, *want)
    status, again = call(daemon, "GET", f"/v1/responses/{rid}", ALICE)
    assert status == 200 and again["id"] == rid  # still there for its own key
    req = urllib.request.Request(daemon.url + "/metrics", headers={"Authorization": f"Bearer {ALICE}"})
    with urllib.request.urlopen(req, timeout=20) as r:
        metrics = r.read().decode()
    stored = next(line for line in metrics.splitlines() if line.startswith("minibatch_responses_stored_bytes "))
    assert int(stored.split()[1]) > 0 and "minibatch_responses_evicted_total 0" in metrics
    # the engine shows its own request ids, never the response's
    _, steps = call(daemon, "GET", "/v1/engine/steps?since=0", ALICE)
    assert rid not in json.dumps(steps) and "respreq-" in json.dumps(steps)


def test_a_continuation_leaves_the_stored_conversation_as_it_was():
    """A continuation whose input adds a call to the stored answer's calls builds its own list: the stored
    conversation (and the store's copy of it) stays as it was."""
    from minibatch.daemon.api.responses import conversation
    from minibatch.daemon.api.responses_bodies import ResponsesRequest

    c1 = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}
    stored = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [c1]}]
    store = ResponseStore()
    store.put({"id": "resp_" + "1" * 24}, stored, "alice")
    earlier = store.get("resp_" + "1" * 24, "alice")[1]
    extra = {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"}
    body = ResponsesRequest.model_validate({"input": [extra], "previous_response_id": "resp_" + "1" * 24})
    out = conversation(body, earlier)
    assert [c["id"] for c in out[-1]["tool_calls"]] == ["c1", "c2"]
    assert [c["id"] for c in earlier[-1]["tool_calls"]] == ["c1"]
    assert [c["id"] for c in store.get("resp_" + "1" * 24, "alice")[1][-1]["tool_calls"]] == ["c1"]


@pytest.mark.parametrize(
    "metadata",
    [
        {f"k{i}": "v" for i in range(17)},
        {"k" * (METADATA_KEY + 1): "v"},
        {"k": "v" * (METADATA_VALUE + 1)},
    ],
)
def test_metadata_past_openais_limits_is_a_400_naming_it(daemon, metadata):
    status, body = call(
        daemon, "POST", "/v1/responses", ALICE, {"input": "hi", "max_output_tokens": 2, "metadata": metadata}
    )
    assert status == 400 and body["error"]["param"].startswith("metadata"), body


def test_only_the_operator_changes_the_lifetime_of_the_model_it_loaded(daemon):
    """A key's request neither unloads the daemon's own model (keep_alive 0 is a 403 naming keep_alive) nor
    shortens its life (a keep_alive of a second leaves it loaded for good); the socket's user may."""
    from minibatch.daemon.client import request_json

    own = call(daemon, "GET", "/health", ALICE)[1]["model"]
    status, refused = call(daemon, "POST", "/api/generate", ALICE, {"model": own, "keep_alive": 0})
    assert status == 403 and refused["error"].startswith("keep_alive: "), refused
    ask = {"model": own, "prompt": "hi", "stream": False, "keep_alive": "1s", "options": {"num_predict": 2}}
    assert call(daemon, "POST", "/api/generate", ALICE, ask)[0] == 200
    (ps,) = call(daemon, "GET", "/api/ps", ALICE)[1]["models"]
    assert ps["expires_at"].startswith("0001-01-01")  # still kept for good
    status, out = request_json(str(daemon.socket), "POST", "/api/generate", {"model": own, "keep_alive": 0}, timeout=30)
    assert status == 200 and out["done_reason"] == "unload", out  # the operator's own request, over the socket
    body = {"model": own, "stream": False}
    status, out = request_json(str(daemon.socket), "POST", "/api/generate", body, timeout=60)
    assert status == 200 and out["done_reason"] == "load"
    (ps,) = call(daemon, "GET", "/api/ps", ALICE)[1]["models"]
    assert ps["expires_at"].startswith("0001-01-01")  # loaded again, it is the operator's again: kept

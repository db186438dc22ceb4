"""Check 17: property-based fuzzing of every endpoint from the daemon's own OpenAPI document.

schemathesis makes bodies, query strings and headers from the document the daemon serves at
/openapi.json, valid ones and ones that break it (negative mode), and sends them to the real daemon on
its socket, then over its TCP listener with a key. Every answer must be no 5xx and conform to the
document (status code, content type, headers, body schema), and data that breaks the document must be
refused with a 4xx. After the run the daemon is clean: /health ok, nothing running or waiting, the KV
pool back to its idle level. `scripts/fuzz.sh` runs the same with many more examples.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from minibatch.daemon.api.openapi import document
from minibatch.daemon.api.rerank import PATHS as RERANK_PATHS
from tests.daemon.helpers import Daemon, with_fim_markers

from .conftest import assert_clean

schemathesis = pytest.importorskip("schemathesis")
httpx = pytest.importorskip("httpx")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode, checks  # noqa: E402

KEY = "fuzz-key-0123456789abcdef"
# Examples per operation and mode (MINIBATCH_FUZZ_EXAMPLES raises it: scripts/fuzz.sh).
EXAMPLES = int(os.environ.get("MINIBATCH_FUZZ_EXAMPLES", "12"))
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_headers_conformance,
    checks.response_schema_conformance,
    checks.negative_data_rejection,
]
# Left out: positive_data_acceptance, since a request the document allows may still be refused for what
# no schema can state (a prompt over the context, a model name that is not the one served, a full queue).
ENDLESS = {("get", "/v1/engine/events"): "an event stream that lasts as long as the client (tests/daemon covers it)"}
# A random id names no stored response: these answer 404s only (checked against the document all the same;
# tests/daemon/test_responses_api.py covers them with real ids).
BLIND = {("get", "/v1/responses/{response_id}"), ("delete", "/v1/responses/{response_id}")}
# The daemon's own user's (over its socket, showing no key); the fuzzer shows a key: 403 only (checked against the
# document all the same; tests/daemon/test_prompt_cache.py covers them as the operator).
OPERATOR = {("delete", "/v1/prompt-cache")}
OPERATIONS = [
    pytest.param(method, path, id=f"{method.upper()} {path}", marks=pytest.mark.skip(ENDLESS[(method, path)]))
    if (method, path) in ENDLESS
    else pytest.param(method, path, id=f"{method.upper()} {path}")
    for path, ops in document()["paths"].items()
    for method in ops
]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def rerank_daemon(tmp_path_factory):
    """A daemon whose own model is a reranker (a tiny XLM-RoBERTa cross-encoder), for the rerank operations: the
    chat model's daemon refuses every one of them as a model that cannot rerank."""
    from make_encoder import save_xlmr_reranker

    model = save_xlmr_reranker(tmp_path_factory.mktemp("fuzz-reranker") / "reranker")
    d = tempfile.mkdtemp(prefix="mbfr-", dir="/tmp")
    port = free_port()
    daemon = Daemon(Path(d) / "d.sock", model, "--max-num-seqs", "4", "--port", str(port), "--api-key", KEY)
    daemon.wait_ready()
    daemon.port = port
    daemon.baseline = daemon.stats()["kv_blocks_used"]
    yield daemon
    assert daemon.stop() == 0, daemon.log_text()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def fuzz_daemon(tiny_chat_model_dir, tmp_path_factory):
    d = tempfile.mkdtemp(prefix="mbf-", dir="/tmp")
    port = free_port()
    # fill-in-the-middle markers, so that /infill and a suffix serve too
    model = with_fim_markers(tiny_chat_model_dir, tmp_path_factory.mktemp("fuzz") / "model")
    # A short context keeps every generated request quick: max_tokens past it is refused.
    daemon = Daemon(
        Path(d) / "d.sock",
        model,
        "--max-num-seqs",
        "4",
        "--max-queue",
        "8",
        "--max-model-len",
        "96",
        "--kv-cache-gb",
        "0.05",
        "--port",
        str(port),
        "--api-key",
        KEY,
    ).wait_ready()
    daemon.port = port
    daemon.baseline = daemon.stats()["kv_blocks_used"]
    yield daemon
    assert daemon.stop() == 0, daemon.log_text()
    shutil.rmtree(d, ignore_errors=True)


AUTH = {"Authorization": f"Bearer {KEY}"}  # the control endpoint wants it on the socket too


def client_for(daemon, listener: str):
    """(an httpx client, the host to address) for the daemon's socket or its TCP listener."""
    if listener == "socket":
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.socket)), timeout=60), "localhost"
    return httpx.Client(timeout=60), f"127.0.0.1:{daemon.port}"


@pytest.fixture(scope="module")
def served(fuzz_daemon):
    client, host = client_for(fuzz_daemon, "socket")
    with client:
        doc = client.get(f"http://{host}/openapi.json").json()
        health = client.get(f"http://{host}/health").json()
    assert doc == document(health["model"], health["vocab_size"])  # what the daemon serves is what the code makes
    return schemathesis.openapi.from_dict(doc)


def fuzz(schema, method: str, path: str, client, host: str, headers: dict, examples: int) -> Counter:
    """Status code -> answers, over the valid and (where there is something to break) the invalid cases."""
    op = schema.find_operation_by_path(method, path)
    spec = document()["paths"][path][method]
    breakable = "requestBody" in spec or "parameters" in spec  # else negative mode has nothing to break
    sent = []
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if breakable else (GenerationMode.POSITIVE,):

        @given(case=op.as_strategy(mode))
        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        def run(case):
            kwargs = case.as_transport_kwargs(base_url=f"http://{host}", headers=headers)
            kwargs.pop("cookies", None)
            if "data" in kwargs:  # raw bytes or text (negative mode's non-JSON bodies)
                kwargs["content"] = kwargs.pop("data")
            response = client.request(**kwargs)
            sent.append(response.status_code)
            case.validate_response(response, checks=CHECKS)

        run()
    return Counter(sent)


@pytest.mark.parametrize("listener", ["socket", "tcp"])
@pytest.mark.parametrize("method, path", OPERATIONS)
def test_check17_fuzz_every_operation(fuzz_daemon, served, method, path, listener, request):
    daemon = request.getfixturevalue("rerank_daemon") if path in RERANK_PATHS else fuzz_daemon
    client, host = client_for(daemon, listener)
    with client:
        got = fuzz(
            served, method, path, client, host, AUTH, EXAMPLES if listener == "socket" else max(2, EXAMPLES // 3)
        )
    if (method, path) in BLIND:
        assert set(got) == {404}, got
    elif (method, path) in OPERATOR:
        assert set(got) == {403}, got
    else:
        assert any(200 <= code < 300 for code in got), got  # valid cases get served, not only refused
    if daemon is not fuzz_daemon:
        assert_clean(daemon)


def test_check17_the_daemon_is_clean_after_the_fuzzing(fuzz_daemon):
    stats = assert_clean(fuzz_daemon)
    assert stats["running"] == 0 and stats["waiting"] == 0
    status, health = fuzz_daemon.get("/health")
    assert status == 200 and health["status"] == "ok"

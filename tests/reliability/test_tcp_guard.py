"""Check 16: the TCP listener lets in only who belongs (keys, Host, Origin, content type, CORS, bind refusal).

Everything talks to the real daemon on a loopback port; nothing is sent to any
address outside loopback.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.daemon.helpers import Daemon

KEY = "test-key-0123456789abcdef"
ORIGIN = "http://app.example"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(
    port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None
) -> tuple[int, dict, dict]:
    """One raw HTTP request with exactly the headers given (Host included); (status, headers, JSON body or {})."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        hdrs = {"Host": f"127.0.0.1:{port}", **(headers or {})}
        if body is not None:
            hdrs["Content-Length"] = str(len(body))
        for k, v in hdrs.items():
            if v is not None:
                conn.putheader(k, v)
        conn.endheaders(body)
        r = conn.getresponse()
        raw = r.read()
        try:
            data = json.loads(raw) if raw else {}
        except ValueError:
            data = {"raw": raw.decode(errors="replace")}
        return r.status, dict(r.headers), data
    finally:
        conn.close()


COMPLETION = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
MODE = json.dumps({"mode": "continuous"}).encode()
EVIL = {"Content-Type": "text/plain", "Origin": "http://evil.example"}


@pytest.fixture(scope="module")
def open_daemon(tiny_chat_model_dir):
    """Loopback TCP, no key: the default a user gets with --port."""
    sock_dir = Path(tempfile.mkdtemp(prefix="mbg-", dir="/tmp"))
    port = free_port()
    daemon = Daemon(sock_dir / "d.sock", tiny_chat_model_dir, "--port", str(port), "--kv-cache-gb", "0.05").wait_ready()
    daemon.port = port
    yield daemon
    assert daemon.stop() == 0, daemon.log_text()
    shutil.rmtree(sock_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def keyed_daemon(tiny_chat_model_dir):
    """Loopback TCP with a key given on the command line and one allowed browser origin."""
    sock_dir = Path(tempfile.mkdtemp(prefix="mbk-", dir="/tmp"))
    port = free_port()
    daemon = Daemon(
        sock_dir / "d.sock",
        tiny_chat_model_dir,
        "--port",
        str(port),
        "--kv-cache-gb",
        "0.05",
        "--api-key",
        KEY,
        "--allowed-origins",
        ORIGIN,
    ).wait_ready()
    daemon.port = port
    yield daemon
    assert daemon.stop() == 0, daemon.log_text()
    shutil.rmtree(sock_dir, ignore_errors=True)


def test_check16_the_cross_site_requests_of_the_report_are_refused(open_daemon):
    port = open_daemon.port
    foreign = {**EVIL, "Host": f"evil.example:{port}"}
    # exactly the two requests of the report: a foreign Host is refused first (DNS rebinding)
    status, _, body = http(port, "POST", "/v1/completions", COMPLETION, foreign)
    assert status == 403 and body["error"]["param"] == "Host", body
    status, _, body = http(port, "PUT", "/v1/engine/mode", MODE, foreign)
    assert status == 403 and body["error"]["param"] == "Host", body
    # our own Host, but a web page's Origin: refused
    status, _, body = http(port, "POST", "/v1/completions", COMPLETION, EVIL)
    assert status == 403 and body["error"]["param"] == "Origin", body
    # no Origin, text/plain body (what `curl -d` or a form would send): 415 naming the header
    status, _, body = http(port, "POST", "/v1/completions", COMPLETION, {"Content-Type": "text/plain"})
    assert status == 415 and body["error"]["param"] == "Content-Type" and "application/json" in body["error"]["message"]
    status, _, body = http(port, "PUT", "/v1/engine/mode", MODE, {"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 415, body
    status, _, body = http(port, "POST", "/v1/completions", COMPLETION, {})
    assert status == 415 and "no Content-Type" in body["error"]["message"]
    # the same with proper headers is served
    status, _, body = http(port, "POST", "/v1/completions", COMPLETION, {"Content-Type": "application/json"})
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body
    status, _, body = http(
        port,
        "POST",
        "/v1/completions",
        COMPLETION,
        {"Content-Type": "application/json; charset=utf-8", "Host": f"localhost:{port}"},
    )
    assert status == 200, body
    status, _, body = http(port, "PUT", "/v1/engine/mode", MODE, {"Content-Type": "application/json"})
    assert status == 202, body
    # a preflight from an origin nobody allowed gets no CORS grant
    status, headers, _ = http(
        port,
        "OPTIONS",
        "/v1/completions",
        None,
        {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert status == 403 and "Access-Control-Allow-Origin" not in headers
    # the Unix socket is unaffected: its permissions are its guard
    from minibatch.daemon.client import request_json

    status, body = request_json(str(open_daemon.socket), "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 200, body


def test_check16_key_required_wrong_and_right_and_counted(keyed_daemon):
    port = keyed_daemon.port
    json_h = {"Content-Type": "application/json"}
    status, headers, body = http(port, "POST", "/v1/completions", COMPLETION, json_h)
    assert status == 401 and headers.get("WWW-Authenticate") == "Bearer" and body["error"]["param"] == "Authorization"
    status, headers, body = http(
        port, "POST", "/v1/completions", COMPLETION, {**json_h, "Authorization": "Bearer wrong-key-xxxxxxxx"}
    )
    assert status == 401 and headers.get("WWW-Authenticate") == "Bearer" and body["error"]["code"] == "invalid_api_key"
    status, _, _ = http(port, "POST", "/v1/completions", COMPLETION, {**json_h, "Authorization": f"Basic {KEY}"})
    assert status == 401
    for path in ("/health", "/v1/models", "/metrics", "/v1/engine/stats"):
        assert http(port, "GET", path)[0] == 401, path
    auth = {"Authorization": f"Bearer {KEY}"}
    status, _, body = http(port, "POST", "/v1/completions", COMPLETION, {**json_h, **auth})
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    status, _, health = http(port, "GET", "/health", None, auth)
    assert status == 200 and KEY not in json.dumps(health)
    status, _, raw = http(port, "GET", "/metrics", None, auth)
    counted = {
        line.split("{")[1].split("}")[0]: float(line.split()[-1])
        for line in raw["raw"].splitlines()
        if line.startswith("minibatch_http_refused_total")
    }
    assert counted['reason="unauthorized"'] >= 7, counted
    # key or not, the content type is still checked
    status, _, _ = http(port, "POST", "/v1/completions", COMPLETION, {"Content-Type": "text/plain", **auth})
    assert status == 415
    # the key is in no log line, no error body, no process title
    log = keyed_daemon.log_text()
    assert KEY not in log and "1 API key" in log
    cmdline = Path(f"/proc/{keyed_daemon.pid}/cmdline").read_bytes().decode(errors="replace")
    assert KEY not in cmdline and "--port" in cmdline


def test_check16_control_endpoints_need_the_key_on_the_socket_too(keyed_daemon):
    from minibatch.daemon.client import request_json

    sock = str(keyed_daemon.socket)
    status, body = request_json(sock, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 200, body  # serving stays key-free on the socket
    status, body = request_json(sock, "PUT", "/v1/engine/mode", {"mode": "continuous"})
    assert status == 401 and body["error"]["param"] == "Authorization"
    status, body = request_json(sock, "PUT", "/v1/engine/mode", {"mode": "continuous"}, api_key=KEY)
    assert status == 202, body


def test_check16_cors_preflight_and_answers_for_an_allowed_origin(keyed_daemon):
    port = keyed_daemon.port
    status, headers, _ = http(
        port,
        "OPTIONS",
        "/v1/chat/completions",
        None,
        {
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == ORIGIN and "Origin" in headers["Vary"]
    assert headers["Access-Control-Allow-Methods"] == "POST"
    assert set(h.strip().lower() for h in headers["Access-Control-Allow-Headers"].split(",")) == {
        "authorization",
        "content-type",
        "x-api-key",  # Anthropic's clients send their key and version in these
        "anthropic-version",
    }
    status, headers, _ = http(
        port, "OPTIONS", "/v1/engine/mode", None, {"Origin": ORIGIN, "Access-Control-Request-Method": "PUT"}
    )
    assert status == 204 and headers["Access-Control-Allow-Methods"] == "GET, PUT"
    status, _, _ = http(
        port, "OPTIONS", "/v1/nothing-here", None, {"Origin": ORIGIN, "Access-Control-Request-Method": "GET"}
    )
    assert status == 404
    # the real request from that origin: key still required, and the answer carries the grant
    status, headers, _ = http(
        port, "POST", "/v1/completions", COMPLETION, {"Origin": ORIGIN, "Content-Type": "application/json"}
    )
    assert status == 401 and headers["Access-Control-Allow-Origin"] == ORIGIN  # the page can read why
    status, headers, body = http(
        port,
        "POST",
        "/v1/completions",
        COMPLETION,
        {"Origin": ORIGIN, "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    assert status == 200 and headers["Access-Control-Allow-Origin"] == ORIGIN, body
    status, headers, _ = http(
        port,
        "POST",
        "/v1/completions",
        COMPLETION,
        {"Origin": "http://other.example", "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    assert status == 403 and "Access-Control-Allow-Origin" not in headers


def test_check16_the_openai_sdk_works_with_the_key_over_tcp(keyed_daemon):
    openai = pytest.importorskip("openai")
    base = f"http://127.0.0.1:{keyed_daemon.port}/v1"
    client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
    out = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Hello!"}], max_tokens=4
    )
    assert out.usage.completion_tokens >= 1 and out.choices[0].message.content is not None
    chunks = list(
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True
        )
    )
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
    bad = openai.OpenAI(base_url=base, api_key="not-the-key-123", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="default", prompt="hi", max_tokens=2)


def test_check16_the_chat_client_works_with_the_key_over_tcp(keyed_daemon):
    from minibatch.tui.client import DaemonClient, DaemonUnavailable

    async def go():
        client = DaemonClient(f"http://127.0.0.1:{keyed_daemon.port}", KEY)
        try:
            health = await client.health()
            mode = await client.set_mode("continuous")
            deltas = [d async for d in client.chat([{"role": "user", "content": "Hello!"}], max_tokens=3)]
            events = client.events()
            first = await events.__anext__()
            await events.aclose()
        finally:
            await client.close()
        anonymous = DaemonClient(f"http://127.0.0.1:{keyed_daemon.port}")
        try:
            with pytest.raises(DaemonUnavailable, match="API key"):
                await anonymous.health()
        finally:
            await anonymous.close()
        return health, mode, deltas, first

    health, mode, deltas, first = asyncio.run(go())
    assert health["status"] == "ok" and mode["requested_mode"] == "continuous"
    assert deltas[0].request_id and deltas[-1].usage["completion_tokens"] == 3 and not any(d.error for d in deltas)
    assert "running" in first
    # the chat's command line refuses clearly without the key
    r = subprocess.run(
        [sys.executable, "-m", "minibatch.tui.cli", "--url", f"http://127.0.0.1:{keyed_daemon.port}"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"},
    )
    assert r.returncode == 1 and "needs an API key" in r.stderr, r.stderr


@pytest.mark.parametrize("foreground", [True, False])
def test_check16_non_loopback_bind_without_a_key_refuses_before_anything_binds(
    tiny_chat_model_dir, short_tmp, foreground
):
    port = free_port()
    sock = short_tmp / "d.sock"
    args = [
        "start",
        "--socket",
        str(sock),
        "--model",
        str(tiny_chat_model_dir),
        "--host",
        "0.0.0.0",
        "--port",
        str(port),
        "--log-file",
        str(short_tmp / "log"),
    ]
    env = {k: v for k, v in os.environ.items() if k != "MINIBATCH_API_KEY"}
    started = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "minibatch.daemon.cli", *args, *(["--foreground"] if foreground else [])],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 2, r.stderr
    assert "--api-key" in r.stderr and "--insecure-no-auth" in r.stderr and "0.0.0.0" in r.stderr
    assert time.monotonic() - started < 30  # refused up front, no model load
    assert not sock.exists()
    with socket.socket() as s:  # the port was never taken
        s.bind(("127.0.0.1", port))

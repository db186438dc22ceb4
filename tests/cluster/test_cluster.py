"""minibatch-serve end to end: a real local Ray cluster started by the real command, 2 CPU replicas of the
built-in model with one thread each, reached through the ingress's TCP listener (with a key) and socket.

The tests run in file order on one cluster: the replica kill comes near the end, the drain on stop last.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from minibatch.daemon.client import request_json

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="Ray Serve is not installed (pip install minibatch[cluster])"
)

KEY = "cluster-test-key"
MODEL = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_cli(*args: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "minibatch.daemon.cluster.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


class Ingress:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.socket = folder / "serve.sock"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = folder / "serve.log"
        self.env = {**os.environ, "MINIBATCH_SERVE_LOG_FILE": str(self.log), "MINIBATCH_API_KEY": KEY}

    def get(self, path: str, timeout: float = 20) -> tuple[int, dict]:
        return request_json(self.url, "GET", path, timeout=timeout, api_key=KEY)

    def send(self, method: str, path: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
        return request_json(self.url, method, path, body, timeout=timeout, api_key=KEY)

    def replicas(self) -> list[dict]:
        status, health = self.get("/health")
        return health.get("cluster", {}).get("replicas", []) if status == 200 else []

    def chat(self, messages: list[dict], **kw) -> tuple[str, dict]:
        """(the replica that answered, the answer) over TCP."""
        req = urllib.request.Request(
            self.url + "/v1/chat/completions",
            data=json.dumps({"messages": messages, "max_tokens": 6, "temperature": 0, **kw}).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.headers["X-Minibatch-Replica"], json.loads(resp.read())


@pytest.fixture(scope="module")
def cluster():
    folder = Path(__import__("tempfile").mkdtemp(prefix="mbc-", dir="/tmp"))
    os.chmod(folder, 0o700)
    ing = Ingress(folder)
    out = serve_cli(
        "start",
        "--socket",
        str(ing.socket),
        "--replicas",
        "2",
        "--threads",
        "1",
        "--port",
        str(ing.port),
        "--kv-cache-tokens",
        "8192",
        env=ing.env,
    )
    assert out.returncode == 0, out.stderr + (ing.log.read_text() if ing.log.exists() else "")
    try:
        yield ing
    finally:
        if (ing.folder / "serve.sock.lock").exists():
            serve_cli("stop", "--socket", str(ing.socket), env=ing.env, timeout=120)
        shutil.rmtree(folder, ignore_errors=True)


def test_start_returns_when_both_replicas_serve(cluster):
    reps = cluster.replicas()
    assert len(reps) == 2 and all(r["status"] == "ok" for r in reps)
    status, health = cluster.get("/health")
    assert status == 200 and health["model"] == MODEL and health["cluster"]["wanted"] == "2"
    assert health["max_num_seqs"] == 32  # the model's facts come through from a replica
    out = serve_cli("status", "--socket", str(cluster.socket), env=cluster.env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 live (wanted 2)" in out.stdout and out.stdout.count("replica: ") == 2


def test_the_openai_sdk_through_the_ingress(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=cluster.url + "/v1", api_key=KEY, max_retries=0)
    msgs = [{"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0)
    assert whole.choices[0].message.content and whole.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # the same greedy answer, token by token
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 3
    comp = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert comp.choices[0].text and comp.usage.completion_tokens == 4
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_the_ollama_client_through_the_ingress(cluster):
    import ollama

    client = ollama.Client(host=cluster.url, headers={"Authorization": f"Bearer {KEY}"})
    msgs = [{"role": "user", "content": "Say hi."}]
    # Once first, so that both answers compared below start from the prompt's cached blocks: on the default
    # native weights a prompt computed whole and one whose last token alone is computed after a prefix hit
    # differ in their last bits, and this prompt's first token is a near-tie ("I" against "Hello", 0.015
    # apart in log-probability), which such bits can turn either way.
    client.chat(model=MODEL, messages=msgs, options={"num_predict": 1, "temperature": 0})
    whole = client.chat(model=MODEL, messages=msgs, options={"num_predict": 5, "temperature": 0})
    assert whole.message.content and whole.done
    parts = list(client.chat(model=MODEL, messages=msgs, options={"num_predict": 5, "temperature": 0}, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content and parts[-1].done
    assert client.generate(model=MODEL, prompt="One, two,", options={"num_predict": 3}).response
    assert [m.model for m in client.list().models] == [f"{MODEL}:latest"]


def test_conversations_stay_with_their_replica_and_spread_over_both(cluster):
    topics = ["tides", "volcanoes", "owls", "bread", "comets", "glaciers", "bees", "rivers",
              "deserts", "coral", "thunder", "maple trees", "salt", "wolves", "clocks", "kites"]  # fmt: skip
    served: dict[str, list[str]] = {}
    cached_second = []
    for topic in topics:
        first = [{"role": "user", "content": f"In one sentence, what should a child know about {topic}?"}]
        r1, a1 = cluster.chat(first)
        second = first + [
            {"role": "assistant", "content": a1["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And one more fact?"},
        ]
        r2, a2 = cluster.chat(second)
        assert r2 == r1, f"the second turn about {topic} went to {r2}, the first to {r1}"
        cached_second.append(a2["usage"]["prompt_tokens_details"]["cached_tokens"])
        served.setdefault(r1, []).append(topic)
    assert all(c > 0 for c in cached_second), cached_second  # the first turn's blocks were reused
    assert len(served) == 2 and min(len(v) for v in served.values()) >= 2, served
    status, stats = cluster.get("/v1/engine/stats?steps=0")
    assert status == 200 and stats["cached_prompt_tokens"] >= sum(cached_second)
    with urllib.request.urlopen(
        urllib.request.Request(cluster.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}), timeout=30
    ) as resp:
        text = resp.read().decode()
    hits = next(
        line for line in text.splitlines() if line.startswith('minibatch_cluster_route_decisions_total{decision="hit"}')
    )
    assert float(hits.split()[-1]) >= 16  # every second turn found its prefix
    for rid in served:
        assert f'minibatch_requests_total{{replica="{rid}",finish_reason="length",model="' in text


def test_engine_views_total_every_replica(cluster):
    status, stats = cluster.get("/v1/engine/stats?steps=2")
    assert status == 200 and len(stats["replicas"]) == 2
    for key in ("max_num_seqs", "kv_blocks_total", "requests_finished", "prompt_tokens"):
        assert stats[key] == sum(r[key] for r in stats["replicas"])
    one = stats["replicas"][0]["replica"]
    status, single = cluster.get(f"/v1/engine/stats?replica={one}")
    assert status == 200 and single["replica"] == one and single["max_num_seqs"] == 32
    assert cluster.get("/v1/engine/stats?replica=nosuch")[0] == 404
    assert cluster.get("/v1/engine/stats?steps=x")[0] == 400  # the daemon's own validation, once
    status, steps = cluster.get(f"/v1/engine/steps?replica={one}&since=0")
    assert status == 200 and steps["max_rows"] == 32
    req = urllib.request.Request(cluster.url + "/v1/engine/events", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            line = resp.readline()
            if line.startswith(b"data: "):
                event = json.loads(line[6:])
                if len(event["replicas"]) == 2:
                    break
        else:
            pytest.fail("no event covered both replicas")
    assert event["max_num_seqs"] == 64 and {r["replica"] for r in event["replicas"]} == {
        r["replica"] for r in stats["replicas"]
    }


def test_a_client_that_leaves_mid_stream_frees_its_replica(cluster):
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(30)
    sock.connect(str(cluster.socket))
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True, "stream": True})
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    seen = b""
    while seen.count(b"data: ") < 3:
        seen += sock.recv(65536)
    assert b"X-Minibatch-Replica" in seen
    sock.close()  # gone mid-stream
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        _, stats = cluster.get("/v1/engine/stats?steps=0")
        if stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_used"] == 0:
            break
        time.sleep(0.2)
    assert (stats["running"], stats["waiting"], stats["kv_blocks_used"]) == (0, 0, 0), stats


def test_the_mode_switch_reaches_every_replica(cluster):
    status, body = cluster.send("PUT", "/v1/engine/mode", {"mode": "static"})
    assert status == 202 and body["requested_mode"] == "static" and len(body["replicas"]) == 2
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        _, mode = cluster.get("/v1/engine/mode")
        if [r["mode"] for r in mode["replicas"]] == ["static", "static"]:
            break
        time.sleep(0.2)
    assert mode["mode"] == "static" and [r["mode"] for r in mode["replicas"]] == ["static", "static"], mode
    assert cluster.send("PUT", "/v1/engine/mode", {"mode": "sideways"})[0] == 400
    assert cluster.send("PUT", "/v1/engine/mode", {"mode": "continuous"})[0] == 202


def test_the_guard_works_at_the_ingress(cluster):
    def status_of(headers: dict, path: str = "/v1/models", data: bytes | None = None) -> int:
        req = urllib.request.Request(cluster.url + path, headers=headers, data=data)
        try:
            with urllib.request.urlopen(req, timeout=20) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    auth = {"Authorization": f"Bearer {KEY}"}
    assert status_of(auth) == 200
    assert status_of({}) == 401  # no key
    assert status_of({"Authorization": "Bearer wrong"}) == 401
    assert status_of({**auth, "Host": "evil.example:80"}) == 403  # DNS rebinding
    assert status_of({**auth, "Content-Type": "text/plain"}, "/v1/completions", b'{"prompt": "x"}') == 415
    status, _ = request_json(str(cluster.socket), "GET", "/health", timeout=20)  # the socket needs no key
    assert status == 200


def test_a_stored_response_is_found_whichever_replica_a_later_request_reaches(cluster):
    """The ingress routes a response's later requests to the replica that stores it (its id's tag), and tells
    the replicas who sent a request: a response made with the key is not the socket user's."""
    made_on = {}
    for replica in sorted(r["replica"] for r in cluster.replicas()):  # one response stored on each replica
        status, made = cluster.send("POST", f"/v1/responses?replica={replica}", {"input": "Hi", "max_output_tokens": 3})
        assert status == 200, made
        made_on[replica] = made
    assert len(made_on) == 2
    for replica, made in made_on.items():  # whichever replica the router would pick, each is found
        for _ in range(3):
            status, got = cluster.get(f"/v1/responses/{made['id']}")
            assert status == 200 and got["id"] == made["id"], (replica, got)
    rid = made["id"]
    body = {"input": "And?", "max_output_tokens": 3, "previous_response_id": rid}
    for _ in range(3):
        status, more = cluster.send("POST", "/v1/responses", body)
        assert status == 200 and more["usage"]["input_tokens"] > made["usage"]["input_tokens"], more
    status, other = request_json(str(cluster.socket), "GET", f"/v1/responses/{rid}", timeout=20)  # no key: not its
    assert status == 404 and other["error"]["code"] == "response_not_found"
    status, gone = cluster.send("DELETE", f"/v1/responses/{rid}", None)
    assert status == 200 and gone["deleted"]
    assert cluster.get(f"/v1/responses/{rid}")[0] == 404


def test_the_chat_shows_both_replicas_in_a_real_terminal(cluster):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    from tests.tui.test_tmux import screen, tmux, wait_for

    db = cluster.folder / "chat.db"
    env = f"MINIBATCH_CHAT_DB={db} MINIBATCH_API_KEY={KEY}"
    cmd = f"env {env} {sys.executable} -m minibatch.tui.cli --url {cluster.url} --new"
    tmux("kill-server", check=False)
    try:
        tmux("new-session", "-d", "-s", "chat", "-x", "130", "-y", "40", cmd)
        tmux("resize-window", "-t", "chat", "-x", "130", "-y", "40", check=False)
        shown = wait_for(lambda s: "2 replicas" in s, what="the replicas in the engine panel")
        ids = [r["replica"] for r in cluster.replicas()]
        assert all(rid in shown for rid in ids), shown
        tmux("send-keys", "-t", "chat", "-l", "hello there")
        wait_for(lambda s: "hello there" in s, what="the typed text")
        tmux("send-keys", "-t", "chat", "Enter")
        done = wait_for(lambda s: "TTFT" in s, timeout=60, what="an answer")
        assert any(f"replica {rid}" in done for rid in ids), done  # the pane names who answered
        assert "Traceback" not in screen()
    finally:
        tmux("kill-server", check=False)


def test_a_replica_killed_mid_stream(cluster):
    from openai import APIError, OpenAI

    before = cluster.replicas()
    client = OpenAI(base_url=cluster.url + "/v1", api_key=KEY, max_retries=0)
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="Once upon a time", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    victim = raw.headers["x-minibatch-replica"]
    stream = raw.parse()
    got = 0
    with pytest.raises(APIError, match="was lost while serving"):
        for _ in stream:
            got += 1
            if got == 3:
                os.kill(next(r["pid"] for r in before if r["replica"] == victim), signal.SIGKILL)
    assert 3 <= got < 400
    survivor = next(r["replica"] for r in before if r["replica"] != victim)
    for i in range(4):  # the next requests are served at once, by the survivor
        rid, answer = cluster.chat([{"role": "user", "content": f"Count to {i + 2}."}])
        assert rid == survivor and answer["choices"][0]["message"]["content"]
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        now = cluster.replicas()
        if len(now) == 2 and all(r["status"] == "ok" for r in now):
            break
        time.sleep(0.5)
    assert len(now) == 2 and victim not in {r["replica"] for r in now}, now  # Serve started a new one
    newcomer = next(r["replica"] for r in now if r["replica"] != survivor)
    for _ in range(40):  # and the router sends it work: a new conversation that hashes to it
        rid, _ = cluster.chat([{"role": "user", "content": f"Tell me about the number {time.monotonic_ns()}."}])
        if rid == newcomer:
            break
    assert rid == newcomer


def test_stop_drains_the_requests_in_flight(cluster):
    """Long enough that the drain outlasts the 3 s alarm Ray's own SIGTERM handler arms (ours replaces it)."""
    pids = [r["pid"] for r in cluster.replicas()]
    results: dict[int, tuple] = {}

    def long_request(i: int) -> None:
        results[i] = cluster.chat([{"role": "user", "content": f"Story {i}."}], max_tokens=300, ignore_eos=True)

    workers = [threading.Thread(target=long_request, args=(i,)) for i in range(3)]
    for w in workers:
        w.start()
    time.sleep(1.0)
    began = time.monotonic()
    out = serve_cli("stop", "--socket", str(cluster.socket), env=cluster.env, timeout=120)
    for w in workers:
        w.join(90)
    assert out.returncode == 0, out.stdout + out.stderr
    assert time.monotonic() - began > 3  # the drain waited for them
    assert sorted(results) == [0, 1, 2]
    for _, answer in results.values():
        assert answer["usage"]["completion_tokens"] == 300  # finished, not cut off
    assert not cluster.socket.exists() and not (cluster.folder / "serve.sock.lock").exists()
    for pid in pids:  # the replicas' processes are gone with the cluster
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"replica process {pid} outlived the cluster")

"""The disk prompt cache through the real daemon: a restart keeps a long prefix (the same tokens, greedy and
seeded, with the hit counted), `minibatchd prompt-cache` lists and clears it, and API keys do not share
cached prefixes unless the operator allows it."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from minibatch.daemon.client import request_json

from .helpers import Daemon

PROMPT = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(30))  # ~400 tokens


@pytest.fixture
def place():
    d = Path(tempfile.mkdtemp(prefix="mbpc-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def start(place: Path, *args: str) -> Daemon:
    return Daemon(
        place / "d.sock",
        "smollm2-135m-instruct",
        "--prompt-cache-gb",
        "1",
        "--prompt-cache-dir",
        str(place / "cache"),
        "--max-num-seqs",
        "4",
        *args,
    ).wait_ready(300)


def complete(daemon: Daemon, **kw) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 8, **kw}
    status, out = request_json(str(daemon.socket), "POST", "/v1/completions", body, timeout=300)
    assert status == 200, out
    return out


def cli(place: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "minibatch.daemon.cli", "prompt-cache", "--socket", str(place / "d.sock"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "MINIBATCH_PROMPT_CACHE_DIR": str(place / "cache")},
    )


def test_a_restart_keeps_the_prefix_and_the_cli_lists_and_clears_it(place):
    daemon = start(place)
    try:
        greedy = complete(daemon, temperature=0)
        seeded = complete(daemon, temperature=0.9, seed=7)
        assert greedy["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        listing = cli(place, "--json")
        assert listing.returncode == 0, listing.stderr
        body = json.loads(listing.stdout)
        assert body["enabled"] and body["blocks"] > 20 and body["models"][0]["loaded"]
        assert body["models"][0]["kv_cache_type"] == "q8_0"
    finally:
        assert daemon.stop() == 0, daemon.log_text()

    daemon = start(place)
    try:
        again = complete(daemon, temperature=0)
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        prompt_tokens = again["usage"]["prompt_tokens"]
        assert again["choices"][0]["text"] == greedy["choices"][0]["text"]
        assert cached == (prompt_tokens - 1) // 16 * 16 and cached > 300
        stats = daemon.stats()
        assert stats["disk_hit_blocks"] == cached // 16 and stats["disk_read_bytes"] > 0
        assert complete(daemon, temperature=0.9, seed=7)["choices"][0]["text"] == seeded["choices"][0]["text"]
        metrics = daemon.metrics()
        assert 'minibatch_prompt_cache_hit_blocks_total{model="smollm2-135m-instruct"}' in metrics
        hits = float(
            metrics.split('minibatch_prompt_cache_hit_blocks_total{model="smollm2-135m-instruct"} ')[1].split()[0]
        )
        assert hits == cached // 16
        assert "minibatch_prompt_cache_bytes " in metrics

        cleared = cli(place, "--clear")
        assert cleared.returncode == 0 and cleared.stdout.startswith("removed "), cleared.stderr
        assert json.loads(cli(place, "--json").stdout)["blocks"] == 0
    finally:
        assert daemon.stop() == 0, daemon.log_text()

    offline = cli(place)  # no daemon: the folder's files
    assert offline.returncode == 0 and "no daemon running" in offline.stdout


def _tcp_complete(url: str, key: str) -> int:
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps({"prompt": PROMPT, "max_tokens": 2, "temperature": 0}).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("shared", [False, True])
def test_api_keys_do_not_share_cached_prefixes_unless_allowed(place, shared):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    keys = "alice=alice-secret-1,bob=bob-secret-22"
    daemon = start(place, "--port", str(port), "--api-key", keys, *(["--prompt-cache-shared"] if shared else []))
    url = f"http://127.0.0.1:{port}"
    try:
        assert _tcp_complete(url, "alice-secret-1") == 0
        bob = _tcp_complete(url, "bob-secret-22")
        assert (bob > 0) == shared  # bob cannot tell by his time to first token what alice sent
        assert _tcp_complete(url, "alice-secret-1") > 0
    finally:
        assert daemon.stop() == 0, daemon.log_text()
    if not shared:  # on disk too: a restart gives bob nothing of alice's
        daemon = start(place, "--port", str(port), "--api-key", keys)
        try:
            assert _tcp_complete(url, "bob-secret-22") > 0  # his own blocks, written before the restart
            assert _tcp_complete(url, "alice-secret-1") > 0
        finally:
            assert daemon.stop() == 0, daemon.log_text()


def test_clearing_is_the_operators_alone(place):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    daemon = start(place, "--port", str(port), "--api-key", "carol=carol-secret-1")
    try:
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/prompt-cache",
            method="DELETE",
            headers={"Authorization": "Bearer carol-secret-1"},
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 403
        listed = json.loads(
            urllib.request.urlopen(
                urllib.request.Request(
                    f"http://127.0.0.1:{port}/v1/prompt-cache", headers={"Authorization": "Bearer carol-secret-1"}
                ),
                timeout=30,
            ).read()
        )
        assert "folder" not in listed and listed["enabled"]
    finally:
        assert daemon.stop() == 0, daemon.log_text()


def test_a_key_sees_neither_counts_nor_paths_and_clearing_names_a_model(place, tiny_chat_model_dir):
    """The folder's blocks are every key's prompts: a client with a key is told whether the cache is on, its
    budget and which models have blocks (by name, never a server path), and no counts; the daemon's own user
    sees all. Clearing with an empty model= clears nothing, and a long name is cut in the answer."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ("--prompt-cache-gb", "1", "--prompt-cache-dir", str(place / "cache"), "--port", str(port))
    daemon = Daemon(place / "d.sock", tiny_chat_model_dir, *args, "--api-key", "carol=carol-secret-1").wait_ready()
    url = f"http://127.0.0.1:{port}"
    try:
        _tcp_complete(url, "carol-secret-1")
        deadline = time.monotonic() + 30
        while (own := daemon.get("/v1/prompt-cache")[1])["blocks"] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)  # (the writer's thread)
        assert own["blocks"] > 0 and own["folder"] == str(place / "cache") and own["models"][0]["blocks"] > 0
        req = urllib.request.Request(url + "/v1/prompt-cache", headers={"Authorization": "Bearer carol-secret-1"})
        seen = json.loads(urllib.request.urlopen(req, timeout=30).read())
        assert set(seen) == {"enabled", "budget_bytes", "models"} and seen["enabled"], seen
        assert [set(m) for m in seen["models"]] == [{"model", "loaded", "kv_cache_type", "block_size", "weights"}]
        assert seen["models"][0]["model"] == tiny_chat_model_dir.name and str(tiny_chat_model_dir) not in str(seen)

        status, out = request_json(str(daemon.socket), "DELETE", "/v1/prompt-cache?model=", timeout=30)
        assert status == 400 and out["error"]["param"] == "model", out
        status, out = request_json(str(daemon.socket), "DELETE", "/v1/prompt-cache?model=" + "x" * 300, timeout=30)
        assert status == 404 and "x" * 64 not in out["error"]["message"], out
        # nothing cleared (the writer's thread may still be adding the request's last blocks)
        assert daemon.get("/v1/prompt-cache")[1]["blocks"] >= own["blocks"]
    finally:
        assert daemon.stop() == 0, daemon.log_text()

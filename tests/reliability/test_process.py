"""Checks 11-13: SIGTERM drain, SIGKILL and restart, one daemon per socket, socket permissions."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
import sys

from minibatch.daemon.paths import lock_path
from tests.daemon.helpers import Daemon, chat_body, read_sse, session


def cli(*args, env=None, timeout=180):
    return subprocess.run(
        [sys.executable, "-m", "minibatch.daemon.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )


def test_check11_sigterm_drains_in_flight_requests_then_exits_cleanly(tiny_chat_model_dir, short_tmp):
    d = Daemon(short_tmp / "d.sock", tiny_chat_model_dir, "--kv-cache-gb", "0.05").wait_ready()

    async def go():
        async with session(d.socket) as s:
            job = asyncio.ensure_future(
                s.post("/v1/chat/completions", json=chat_body(max_tokens=150, ignore_eos=True, stream=True))
            )
            await asyncio.sleep(0.5)
            os.kill(d.pid, signal.SIGTERM)
            await asyncio.sleep(0.2)
            try:
                async with s.post("/v1/chat/completions", json=chat_body(max_tokens=5)) as r:
                    refused = r.status, await r.json()
            except Exception as exc:  # the socket may already be closed to new connections
                refused = (None, repr(exc))
            events, _ = await read_sse(await job)
            return refused, events

    refused, events = asyncio.run(go())
    assert refused[0] in (503, None), refused
    finals = [e for e in events if isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"]]
    assert finals and finals[0]["choices"][0]["finish_reason"] == "length" and events[-1] == "[DONE]"
    assert d.proc.wait(30) == 0
    assert not d.socket.exists() and not lock_path(d.socket).exists()
    assert "draining" in d.log_text()


def test_check11_drain_timeout_ends_the_rest_with_an_explicit_error(tiny_chat_model_dir, short_tmp):
    d = Daemon(
        short_tmp / "d.sock", tiny_chat_model_dir, "--kv-cache-gb", "0.05", "--shutdown-timeout", "0.25"
    ).wait_ready()  # 0.25 s in, then 0.25 s of drain: half the 900 tokens' time (about 1 s on this tiny model)

    async def go():
        async with session(d.socket) as s:
            job = asyncio.ensure_future(
                s.post("/v1/chat/completions", json=chat_body(max_tokens=900, ignore_eos=True, stream=True))
            )
            await asyncio.sleep(0.25)
            os.kill(d.pid, signal.SIGTERM)
            return (await read_sse(await job))[0]

    events = asyncio.run(go())
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert errors and "shutting down" in errors[0]["error"]["message"] and events[-1] == "[DONE]"
    assert d.proc.wait(30) == 0


def test_check12_sigkill_leaves_a_stale_socket_that_the_next_start_replaces(tiny_chat_model_dir, short_tmp):
    sock = short_tmp / "d.sock"
    first = Daemon(sock, tiny_chat_model_dir, "--kv-cache-gb", "0.05").wait_ready()
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    assert sock.exists()  # left behind by the crash
    second = Daemon(sock, tiny_chat_model_dir, "--kv-cache-gb", "0.05").wait_ready()
    try:
        assert second.get("/health")[1]["pid"] == second.pid
    finally:
        assert second.stop() == 0


def test_check12_second_daemon_on_the_same_socket_is_refused_and_the_first_keeps_serving(
    tiny_chat_model_dir, short_tmp
):
    sock = short_tmp / "d.sock"
    first = Daemon(sock, tiny_chat_model_dir, "--kv-cache-gb", "0.05").wait_ready()
    try:
        second = Daemon(sock, tiny_chat_model_dir)
        assert second.proc.wait(60) == 1
        assert f"already running (pid {first.pid})" in second.log_text()
        status, health = first.get("/health")
        assert status == 200 and health["pid"] == first.pid
    finally:
        assert first.stop() == 0


def test_check13_socket_is_private_even_under_umask_000(tiny_chat_model_dir, short_tmp):
    sock = short_tmp / "run" / "d.sock"  # the daemon creates the directory
    d = Daemon(sock, tiny_chat_model_dir, "--kv-cache-gb", "0.05", umask=0).wait_ready()
    try:
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
        assert sock.stat().st_uid == os.getuid()
    finally:
        d.stop()


def test_check13_world_writable_socket_directory_is_refused(tiny_chat_model_dir, short_tmp):
    open_dir = short_tmp / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    out = cli("start", "--foreground", "--socket", str(open_dir / "d.sock"), "--model", str(tiny_chat_model_dir))
    assert out.returncode == 2 and "world-writable" in out.stderr
    assert not (open_dir / "d.sock").exists()

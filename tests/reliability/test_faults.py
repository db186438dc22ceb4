"""Check 10: a forward that raises (injected with MINIBATCH_FAULT_AT_STEP) fails in-flight streams fast, is
reported by /health, and the engine carries on serving new requests."""

from __future__ import annotations

import asyncio
import time

from tests.daemon.helpers import Daemon, chat_body, session

from .conftest import assert_clean


def test_check10_engine_fault(tiny_chat_model_dir, short_tmp):
    d = Daemon(
        short_tmp / "d.sock", tiny_chat_model_dir, "--kv-cache-gb", "0.05", env={"MINIBATCH_FAULT_AT_STEP": "40"}
    ).wait_ready()

    async def stream(s):
        async with s.post("/v1/chat/completions", json=chat_body(max_tokens=300, ignore_eos=True, stream=True)) as r:
            events = []
            async for line in r.content:
                if line.startswith(b"data: "):
                    events.append((time.monotonic(), line.strip()))
            return events

    async def go():
        async with session(d.socket) as s:
            return await asyncio.gather(*(stream(s) for _ in range(3)))

    try:
        results = asyncio.run(go())
        for events in results:
            errors = [(t, e) for t, e in events if b'"error"' in e]
            assert errors and b"injected forward fault at step 40" in errors[0][1], events[-3:]
            assert events[-1][1] == b"data: [DONE]"
            last_token = max(t for t, e in events if b'"content"' in e)
            assert errors[0][0] - last_token < 1.0  # the error arrives within a second
        status, health = d.get("/health")
        assert status == 200 and "injected forward fault" in health["last_error"]
        assert "engine step failed" in d.log_text()

        # recovered: a new request completes normally
        async def again():
            async with session(d.socket) as s:
                async with s.post("/v1/chat/completions", json=chat_body(max_tokens=8, ignore_eos=True)) as r:
                    return r.status, await r.json()

        status, body = asyncio.run(again())
        assert status == 200 and body["usage"]["completion_tokens"] == 8
        assert_clean(d)
    finally:
        assert d.stop() == 0


def test_check10_a_lost_device_fails_health_and_the_daemon_exits_non_zero(tiny_chat_model_dir, short_tmp):
    """A fault after which the device cannot work (a dead CUDA context; injected as N:fatal): in-flight requests end
    with the error, /health stops answering OK, and the daemon exits 3 so a supervisor restarts it."""
    d = Daemon(
        short_tmp / "d.sock", tiny_chat_model_dir, "--kv-cache-gb", "0.05", env={"MINIBATCH_FAULT_AT_STEP": "20:fatal"}
    ).wait_ready()

    async def go():
        async with session(d.socket) as s:
            async with s.post(
                "/v1/chat/completions", json=chat_body(max_tokens=300, ignore_eos=True, stream=True)
            ) as r:
                return [line.strip() async for line in r.content if line.startswith(b"data: ")]

    try:
        events = asyncio.run(go())
        errors = [e for e in events if b'"error"' in e]
        assert errors and b"injected forward fault at step 20" in errors[0] and events[-1] == b"data: [DONE]", events[
            -3:
        ]
        assert d.proc.wait(30) == 3
        log = d.log_text()
        assert "the device is lost" in log and "exiting" in log
    finally:
        d.stop()

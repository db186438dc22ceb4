"""Shared by the load scripts: stream one request over the daemon's socket and time every token."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

# A daemon a script starts keeps no disk prompt cache unless the script asks for one (bench_agent.py does): each
# run measures from the same start, never from blocks an earlier run left on disk.
os.environ.setdefault("MINIBATCH_PROMPT_CACHE_GB", "0")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing


def default_socket() -> str:
    from minibatch.daemon.paths import default_socket as ds

    return str(ds())


@dataclass(slots=True)
class Result:
    """One request as the client saw it (times in seconds, relative to its own send)."""

    index: int
    sent_at: float  # wall clock (monotonic) when sent
    ok: bool = False
    status: int | None = None
    error: str | None = None
    ttft: float | None = None
    token_times: list[float] = field(default_factory=list)  # arrival of each text chunk after the first
    e2e: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    text: str = ""
    server: dict = field(default_factory=dict)  # the daemon's own timings ("minibatch")

    def arrived(self) -> None:
        """A text chunk came now: the first one's time is the TTFT, the later ones' the token times."""
        now = time.monotonic() - self.sent_at
        if self.ttft is None:
            self.ttft = now
        else:
            self.token_times.append(now)

    @property
    def itl(self) -> list[float]:
        times = ([self.ttft] if self.ttft is not None else []) + self.token_times
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.e2e is None or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def session(socket: str | None = None, url: str | None = None, api_key: str | None = None) -> aiohttp.ClientSession:
    """A client session to the daemon's Unix socket, or to any HTTP server at `url`.

    The API key (`api_key`, else $MINIBATCH_API_KEY) goes with every request as a Bearer token.
    """
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    key = api_key or os.environ.get("MINIBATCH_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else None
    if url is not None:
        # One connection per request: servers close idle keep-alive connections on their own
        # schedule (llama-server does), and a request sent on one that is closing fails.
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True), base_url=url, timeout=timeout, headers=headers
        )
    return aiohttp.ClientSession(
        connector=aiohttp.UnixConnector(path=socket, limit=0),
        base_url="http://localhost",
        timeout=timeout,
        headers=headers,
    )


async def wait_mode(s: aiohttp.ClientSession, mode: str, timeout: float = 600) -> None:
    """Ask the daemon for a batching mode and wait until it has switched and nothing runs or waits."""
    async with s.put("/v1/engine/mode", json={"mode": mode}) as r:
        if r.status >= 400:
            raise RuntimeError(f"mode switch: {await r.text()}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        async with s.get("/v1/engine/stats?steps=0") as r:
            st = await r.json()
        if st["mode"] == mode and st["running"] == 0 and st["waiting"] == 0:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"the daemon did not switch to {mode} within {timeout} s")


async def steps_since(s: aiohttp.ClientSession, since: int) -> dict:
    """The daemon's step records after step `since` (GET /v1/engine/steps)."""
    async with s.get(f"/v1/engine/steps?since={since}") as r:
        data = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"/v1/engine/steps answered {r.status}: {data}")
        return data


async def stream_request(s: aiohttp.ClientSession, index: int, body: dict, chat: bool = True) -> Result:
    url = "/v1/chat/completions" if chat else "/v1/completions"
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.monotonic()
    res = Result(index, start)
    parts = []
    try:
        async with s.post(url, json=body) as r:
            res.status = r.status
            if r.status != 200:
                res.error = (await r.json(content_type=None)).get("error", {}).get("message", f"HTTP {r.status}")
                return res
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"] if isinstance(chunk["error"], dict) else str(chunk["error"])
                    return res
                usage = chunk.get("usage") or {}  # in a last chunk of its own (OpenAI), or beside the last choice
                if usage:
                    res.output_tokens = usage.get("completion_tokens", res.output_tokens)
                    res.prompt_tokens = usage.get("prompt_tokens", 0)
                if not chunk.get("choices"):
                    continue
                choice = chunk["choices"][0]
                text = choice["delta"].get("content") if chat else choice.get("text")
                if text:
                    res.arrived()
                    parts.append(text)
                if choice["finish_reason"]:
                    res.finish_reason = choice["finish_reason"]
                    res.server = chunk.get("minibatch", {})
        res.e2e = time.monotonic() - start
        res.text = "".join(parts)
        res.ok = res.finish_reason is not None
    except (aiohttp.ClientError, OSError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def stream_message(s: aiohttp.ClientSession, index: int, body: dict) -> Result:
    """One Anthropic Messages request (`POST /v1/messages`, streamed), timed as stream_request times a chat one."""
    body = {**body, "stream": True}
    start = time.monotonic()
    res = Result(index, start)
    parts = []
    try:
        async with s.post("/v1/messages", json=body) as r:
            res.status = r.status
            if r.status != 200:
                res.error = (await r.json(content_type=None)).get("error", {}).get("message", f"HTTP {r.status}")
                return res
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[6:])
                kind = event["type"]
                if kind == "error":
                    res.error = event["error"]["message"]
                    return res
                if kind == "message_start":
                    usage = event["message"]["usage"]
                    res.prompt_tokens = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
                elif kind == "content_block_delta" and event["delta"]["type"] == "text_delta":
                    res.arrived()
                    parts.append(event["delta"]["text"])
                elif kind == "message_delta":
                    res.output_tokens = event["usage"]["output_tokens"]
                    res.finish_reason = event["delta"]["stop_reason"]
        res.e2e = time.monotonic() - start
        res.text = "".join(parts)
        res.ok = res.finish_reason is not None
    except (aiohttp.ClientError, OSError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


def percentile(values: list[float], p: float) -> float | None:
    """Linear-interpolated percentile (p in [0, 100]); None for no values."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    k = (len(vals) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


def env_socket(arg: str | None) -> str:
    return arg or os.environ.get("MINIBATCH_SOCKET") or default_socket()

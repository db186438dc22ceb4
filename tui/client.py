"""The TUI's only way to the engine: HTTP over the daemon's Unix socket or a TCP URL (no engine imports)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import quote

import aiohttp


class DaemonUnavailable(ConnectionError):
    """Nothing answers on the socket (daemon not running, restarting, or still loading)."""


class ModelNotLoaded(Exception):
    """The daemon answers but has not loaded the model asked for (it loads with the first request naming it)."""


@dataclass(slots=True)
class Delta:
    """One piece of a streamed answer."""

    text: str = ""
    request_id: str | None = None
    replica: str | None = None  # behind minibatch-serve: the replica that answers
    finish_reason: str | None = None
    timings: dict = field(default_factory=dict)
    usage: dict = field(default_factory=dict)
    error: str | None = None


class DaemonClient:
    """`target` is the daemon's socket path or its http:// URL; `api_key` is sent as a Bearer token when given.
    `stream_interval` (seconds, 0: every engine step) is the least time between two chunks of a streamed
    answer: the daemon merges the text that comes sooner (stream_options.interval_ms)."""

    def __init__(self, target: str, api_key: str | None = None, stream_interval: float = 0.0) -> None:
        self.target = target
        self.api_key = api_key
        self.stream_interval = stream_interval
        self._session: aiohttp.ClientSession | None = None

    def _s(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            tcp = self.target.startswith("http://")
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector() if tcp else aiohttp.UnixConnector(path=self.target),
                base_url=self.target if tcp else "http://localhost",
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _json(self, method: str, url: str, body: dict | None = None) -> dict:
        try:
            async with self._s().request(method, url, json=body) as r:
                data = await r.json(content_type=None)
                if r.status >= 400:
                    raise DaemonUnavailable(data.get("error", {}).get("message", f"HTTP {r.status}"))
                return data
        except (aiohttp.ClientConnectionError, OSError) as exc:
            raise DaemonUnavailable(str(exc)) from exc

    async def health(self) -> dict:
        return await self._json("GET", "/health")

    async def models(self) -> list[dict]:
        """Every model the daemon can serve: [{id, loaded, ...}], the loaded ones first."""
        return (await self._json("GET", "/v1/models"))["data"]

    async def set_mode(self, mode: str) -> dict:
        """Every loaded model's batching mode."""
        return await self._json("PUT", "/v1/engine/mode", {"mode": mode})

    async def blocks(self, model: str | None = None) -> dict:
        return await self._json("GET", "/v1/engine/blocks" + _model_query(model, "?"))

    async def steps(self, since: int = 0, model: str | None = None) -> dict:
        """The engine's step records after step `since` (the batch timeline) of `model` (None: the daemon's own)."""
        return await self._json("GET", f"/v1/engine/steps?since={since}" + _model_query(model, "&"))

    async def events(self, model: str | None = None) -> AsyncIterator[dict]:
        """Engine step events of `model` until the connection drops (then DaemonUnavailable)."""
        try:
            async with self._s().get("/v1/engine/events" + _model_query(model, "?")) as r:
                if r.status == 404 and model:
                    raise ModelNotLoaded(model)
                if r.status != 200:
                    raise DaemonUnavailable(f"events: HTTP {r.status}")
                async for line in r.content:
                    if line.startswith(b"data: "):
                        yield json.loads(line[6:])
        except (aiohttp.ClientConnectionError, OSError) as exc:
            raise DaemonUnavailable(str(exc)) from exc
        raise DaemonUnavailable("the event stream ended")

    async def chat(self, messages: list[dict], **params) -> AsyncIterator[Delta]:
        """Stream an answer. Leaving the iteration early closes the connection, which aborts the request."""
        options = {"include_usage": True}
        if self.stream_interval > 0:
            options["interval_ms"] = round(self.stream_interval * 1000)
        body = {"messages": messages, "stream": True, "stream_options": options, **params}
        try:
            async with self._s().post("/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    data = await r.json(content_type=None)
                    yield Delta(error=data.get("error", {}).get("message", f"HTTP {r.status}"))
                    return
                rid = r.headers.get("X-Request-Id")
                yield Delta(request_id=rid, replica=r.headers.get("X-Minibatch-Replica"))
                async for line in r.content:
                    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        yield Delta(error=chunk["error"]["message"])
                        return
                    if not chunk["choices"]:
                        yield Delta(usage=chunk.get("usage", {}))
                        continue
                    choice = chunk["choices"][0]
                    text = choice["delta"].get("content") or ""
                    if text or choice["finish_reason"]:
                        yield Delta(
                            text=text, finish_reason=choice["finish_reason"], timings=chunk.get("minibatch", {})
                        )
        except (aiohttp.ClientConnectionError, OSError) as exc:
            raise DaemonUnavailable(str(exc)) from exc


def _model_query(model: str | None, sep: str) -> str:
    return f"{sep}model={quote(model, safe='')}" if model else ""

"""One engine replica: a Ray Serve deployment whose every replica runs a whole minibatch daemon.

A replica is the daemon itself — `daemon.server.serve` on a thread of its own,
with its engine thread, listening on a private Unix socket in a temporary
folder of the replica's process — so it answers exactly the daemon's API. The
ingress's requests reach it through Serve (`call`, a streaming method), and
the replica relays them to its daemon over that socket and streams the answer
back: first who took it, then the status and headers, then the body as the
daemon writes it (token by token when streaming).

Serve only routes to a replica once its constructor has returned, that is,
once its model is loaded; `check_health` fails when the engine has stopped,
and Serve then replaces the replica.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
from ray import serve

from minibatch.daemon.api.response_store import replica_tag
from minibatch.daemon.client import request_json
from minibatch.daemon.models.settings import PoolSettings
from minibatch.daemon.server import DaemonConfig
from minibatch.daemon.server import serve as serve_daemon
from minibatch.engine.factory import EngineConfig

log = logging.getLogger("minibatch.cluster")

# Headers the replica's daemon answers with that belong to its own connection, not the client's.
HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server", "content-encoding"}
)
FORWARDED_HEADERS = ("Content-Type", "Accept")


async def coalesced(content: aiohttp.StreamReader, interval: float):
    """A body's bytes as they arrive, at most one piece per `interval` seconds: what arrives meanwhile goes
    with the next piece (the first goes at once; 0 relays each as it comes)."""
    loop, last = asyncio.get_running_loop(), -float("inf")
    while chunk := await content.readany():
        wait = interval - (loop.time() - last)
        if wait > 0:
            await asyncio.sleep(wait)
            chunk += content.read_nowait()
        last = loop.time()
        yield chunk


class _Errors(logging.Handler):
    """The daemon's last error, kept so a replica that cannot load says why."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.last: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        self.last = record.getMessage()


class EngineReplica:
    def __init__(
        self,
        engine: EngineConfig,
        request_timeout: float = 600.0,
        read_timeout: float = 30.0,
        shutdown_timeout: float = 30.0,
        start_timeout: float = 600.0,
        stream_interval: float = 0.0,
        prompt_cache_shared: bool = False,
        reasoning_format: str = "auto",
        reasoning_budget: int = -1,
        media_path: str | None = None,
    ) -> None:
        """`stream_interval` (s): send a stream's chunks to the ingress at most this often, coalescing what
        arrives in between (0: each as it comes); every chunk relayed costs both processes Ray's per-item
        work (BENCHMARKS.md, Past one machine). The rest are the replica's daemon's (minibatchd's options)."""
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.pid = os.getpid()
        self.stream_interval = stream_interval
        self._dir = tempfile.mkdtemp(prefix="minibatch-replica-")
        self.socket = Path(self._dir) / "daemon.sock"
        self._errors = _Errors()
        logging.getLogger("minibatch.daemon").addHandler(self._errors)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        config = DaemonConfig(
            engine,
            self.socket,
            shutdown_timeout=shutdown_timeout,
            request_timeout=request_timeout,
            read_timeout=read_timeout,
            models=PoolSettings(on_demand=False),  # an application serves one model (docs/daemon.md, Several models)
            replica_tag=replica_tag(self.replica_id),  # its stored responses' ids say it holds them
            prompt_cache_shared=prompt_cache_shared,
            reasoning_format=reasoning_format,
            reasoning_budget=reasoning_budget,
            media_path=media_path,
        )
        started = threading.Event()

        def run() -> None:
            async def main() -> int:
                self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
                started.set()
                return await serve_daemon(config, self._stop)

            self.exit_code = asyncio.run(main())

        self.exit_code: int | None = None
        self._thread = threading.Thread(target=run, name="minibatch-daemon", daemon=True)
        self._thread.start()
        started.wait()
        self._wait_ready(start_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise RuntimeError(f"replica {self.replica_id}: the engine did not start: {self._errors.last}")
            try:
                status, _ = request_json(str(self.socket), "GET", "/health", timeout=2)
                if status == 200:
                    log.info("replica %s ready (pid %d)", self.replica_id, self.pid)
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"replica {self.replica_id}: not ready after {timeout:.0f} s")

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                base_url="http://replica",
                connector=aiohttp.UnixConnector(path=str(self.socket)),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                auto_decompress=False,
            )
        return self._session

    async def call(
        self,
        method: str,
        path: str,
        headers: dict[str, str] | None = None,
        body: bytes = b"",
        prefix: list[int] | None = None,
        replica: str | None = None,
    ):
        """Relay one request to this replica's daemon: yields ("accepted", replica id, pid), then
        ("head", status, headers), then the body's bytes as they come.

        `prefix` and `replica` are read by the router only. Cancelling the call (the
        client went away) closes the daemon connection, which aborts the request."""
        yield ("accepted", self.replica_id, self.pid)
        async with self._client().request(method, path, headers=headers, data=body or None) as resp:
            kept = [(k, v) for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS]
            yield ("head", resp.status, kept)
            async for chunk in coalesced(resp.content, self.stream_interval):
                yield chunk

    async def fetch(self, method: str, path: str, body: bytes = b"") -> tuple[str, dict, int, bytes]:
        """A whole answer at once, for the ingress's views over every replica (Serve's broadcast):
        (replica id, where it runs: pid and its daemon's socket on its node, status, body)."""
        headers = {"Content-Type": "application/json"} if body else None
        async with self._client().request(method, path, headers=headers, data=body or None) as resp:
            return self.replica_id, {"pid": self.pid, "socket": str(self.socket)}, resp.status, await resp.read()

    async def check_health(self) -> None:
        """Serve's health check: the daemon answers and its engine runs."""
        if not self._thread.is_alive():
            raise RuntimeError(f"replica {self.replica_id}: the daemon has stopped: {self._errors.last}")
        async with self._client().get("/health", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status != 200:
                raise RuntimeError(f"replica {self.replica_id}: /health answered {resp.status}: {await resp.text()}")

    def __del__(self) -> None:
        """Serve stops the replica: drain its daemon as `minibatchd stop` does, then remove its folder."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:
                pass
        self._thread.join(60)
        shutil.rmtree(self._dir, ignore_errors=True)

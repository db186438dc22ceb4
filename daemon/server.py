"""Run the daemon in this process: lock, socket, load the engine, serve, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from minibatch.engine.factory import EngineConfig

from .app import create_app
from .guard import Guard, is_loopback
from .lifecycle import InstanceLock, LifecycleError, private_umask
from .models.names import display_name
from .models.pool import ModelPool, PoolSettings
from .protocol import ApiError
from .state import DaemonState

log = logging.getLogger("minibatch.daemon")


@dataclass
class DaemonConfig:
    engine: EngineConfig  # the daemon's own model (preloaded) and the engine options of every model
    socket: Path
    host: str | None = None
    port: int | None = None
    shutdown_timeout: float = 30.0
    request_timeout: float = 600.0
    read_timeout: float = 30.0
    guard: Guard | None = None
    models: PoolSettings = field(default_factory=PoolSettings)
    preload: tuple[str, ...] = ()  # more models to load at start, after the daemon's own
    reasoning_format: str = "auto"  # a thinking model's reasoning apart (auto) or in the content (none)
    reasoning_budget: int = -1  # thinking tokens at most where a request sets none (-1: no bound)
    # a cluster replica behind the ingress: its tag starts the ids of the responses it stores (so the ingress
    # routes a response's later requests to it), and it takes who sent a request from the ingress's
    # X-Minibatch-Identity header (its socket is private to the cluster's user)
    replica_tag: str | None = None
    prompt_cache_shared: bool = False  # every API key's requests share cached prefixes (state.cache_salt)
    media_path: str | None = None  # the folder file:// image URLs are read in (None: they are refused)


def app_runner(app: web.Application, read_timeout: float) -> web.AppRunner:
    """The runner of a listener's app; keepalive_timeout also drops a connection whose request headers stall
    (none arrive in time)."""
    return web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0, keepalive_timeout=read_timeout
    )


async def listen(runner: web.AppRunner, socket: Path, host: str | None, port: int | None, guard: Guard) -> None:
    """Serve `runner` on the Unix socket (mode 0600) and, with a port, on TCP; log who may come in."""
    await runner.setup()
    with private_umask():
        await web.UnixSite(runner, str(socket)).start()
    os.chmod(socket, 0o600)
    if port is not None:
        await web.TCPSite(runner, host or "127.0.0.1", port).start()
        log.info("also listening on http://%s:%d", host or "127.0.0.1", port)
        if guard.insecure_no_auth and not guard.api_keys and not is_loopback(guard.listen_host):
            log.warning(
                "--insecure-no-auth: anyone who can reach %s:%d may use this daemon without a key",
                guard.listen_host,
                port,
            )
    log.info("access: %s", guard.describe())


async def serve(config: DaemonConfig, stop: asyncio.Event | None = None) -> int:
    """Serve until SIGTERM/SIGINT, or until `stop` is set when one is given (a daemon run off the main
    thread, as a cluster replica runs it, gets no signals)."""
    loop = asyncio.get_running_loop()
    lock = InstanceLock(config.socket)
    try:
        lock.acquire()
    except LifecycleError as exc:
        log.error("%s", exc)
        return 1
    state = DaemonState(
        model_name=display_name(config.engine.model),
        request_timeout=config.request_timeout,
        body_timeout=config.read_timeout,
        reasoning_format=config.reasoning_format,
        reasoning_budget=None if config.reasoning_budget < 0 else config.reasoning_budget,
        replica_tag=config.replica_tag,
        prompt_cache_shared=config.prompt_cache_shared,
        media_path=config.media_path,
    )
    guard = config.guard or Guard()
    runner = app_runner(create_app(state, guard), config.read_timeout)
    signals = stop is None
    stop = stop or asyncio.Event()
    try:
        await listen(runner, config.socket, config.host, config.port, guard)
        for sig in (signal.SIGTERM, signal.SIGINT) if signals else ():
            loop.add_signal_handler(sig, stop.set)
        log.info("listening on %s (pid %d); loading model %s", config.socket, os.getpid(), config.engine.model)
        pool = state.pool = ModelPool(config.engine, config.models, loop)
        try:
            await pool.preload([config.engine.model, *config.preload])
        except ApiError as exc:
            state.status, state.load_error = "failed", exc.message
            log.error("could not load the model: %s", state.load_error)
            return 1
        state.status = "ready"
        pool.start_expiry()
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(pool.lost.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        if pool.lost.is_set() and not stop.is_set():
            # The engine cannot serve again (a lost device): exit non-zero so a supervisor restarts the daemon.
            state.status, state.load_error = "failed", pool.lost_error
            log.critical("exiting: %s", pool.lost_error or "the engine loop ended")
            await asyncio.sleep(0.2)  # let the error events reach their clients
            return 3
        await drain(state, config.shutdown_timeout)
        return 0
    finally:
        await runner.cleanup()
        if state.pool is not None:
            await state.pool.close()
        lock.release()
        log.info("stopped")


async def drain(state: DaemonState, timeout: float) -> None:
    """Refuse new requests, let in-flight ones finish for up to `timeout` s, then end the rest with an error."""
    state.status = "draining"
    pool = state.pool
    if pool is None or not pool.models:
        return
    running = sum(m.engine.state.running for m in pool.models.values())
    waiting = sum(m.engine.state.waiting for m in pool.models.values())
    log.info("draining: %d running, %d waiting (up to %.0f s)", running, waiting, timeout)
    deadline = time.monotonic() + timeout
    while not pool.idle and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if not pool.idle:
        log.warning("drain timeout: aborting the requests still in flight")
        pool.abort_all("the daemon is shutting down; the request was aborted after the drain timeout")
        for _ in range(100):
            if pool.idle:
                break
            await asyncio.sleep(0.02)
    await asyncio.sleep(0.1)  # let the last chunks reach their clients

"""Run the daemon in this process: lock, socket, load the engine, serve, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from minibatch.engine.factory import EngineConfig

from .app import create_app
from .guard import Guard, is_loopback
from .lifecycle import InstanceLock, LifecycleError, private_umask
from .state import DaemonState

log = logging.getLogger("minibatch.daemon")


@dataclass
class DaemonConfig:
    engine: EngineConfig
    socket: Path
    host: str | None = None
    port: int | None = None
    shutdown_timeout: float = 30.0
    request_timeout: float = 600.0
    read_timeout: float = 30.0
    guard: Guard | None = None


def load_engine(config: EngineConfig):
    """Build the engine (it takes seconds, longer on a first conversion)."""
    from minibatch.engine.async_engine import AsyncEngine
    from minibatch.engine.factory import build_engine

    engine = build_engine(config)
    return AsyncEngine(engine), engine.tokenizer


def start_engine_thread(
    config: EngineConfig, loop: asyncio.AbstractEventLoop, stopped: asyncio.Event | None = None
) -> asyncio.Future:
    """Load the model and run the step loop on one thread of their own; the future gets (engine, tokenizer).

    One thread does all tensor work, so the process keeps one OpenMP thread
    pool (see AsyncEngine.run_on_this_thread); the event loop's thread never
    runs any.
    """
    fut = loop.create_future()

    def post(fn, *args) -> None:
        loop.call_soon_threadsafe(lambda: fut.done() or fn(*args))

    def main() -> None:
        try:
            engine, tokenizer = load_engine(config)
        except BaseException as exc:  # noqa: BLE001 - reported to the event loop
            post(fut.set_exception, exc)
            return
        engine.run_on_this_thread(ready=lambda: post(fut.set_result, (engine, tokenizer)))
        if stopped is not None:  # the step loop ended: shutdown, or a lost device
            loop.call_soon_threadsafe(stopped.set)

    threading.Thread(target=main, name="minibatch-engine", daemon=True).start()
    return fut


def grammar_compiler(engine, tokenizer):
    """What compiles response formats for this model (its vocabulary is read on first use), or None."""
    from minibatch.engine.text.structured import GrammarCompiler

    if not tokenizer.has_tokenizer_json:
        return None
    return GrammarCompiler(tokenizer.tokenizer_json, engine.info.vocab_size, list(engine.info.eos_token_ids))


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
        model_name=config.engine.model, request_timeout=config.request_timeout, body_timeout=config.read_timeout
    )
    guard = config.guard or Guard()
    runner = app_runner(create_app(state, guard), config.read_timeout)
    signals = stop is None
    stop, engine_stopped = stop or asyncio.Event(), asyncio.Event()
    try:
        await listen(runner, config.socket, config.host, config.port, guard)
        for sig in (signal.SIGTERM, signal.SIGINT) if signals else ():
            loop.add_signal_handler(sig, stop.set)
        log.info("listening on %s (pid %d); loading model %s", config.socket, os.getpid(), config.engine.model)

        started = time.perf_counter()
        try:
            engine, tokenizer = await start_engine_thread(config.engine, loop, engine_stopped)
        except Exception as exc:
            state.status, state.load_error = "failed", f"{type(exc).__name__}: {exc}"
            log.error("could not load the model: %s", state.load_error)
            return 1
        from .monitor import EngineMonitor

        state.monitor = EngineMonitor(loop)
        engine.stats_listeners.append(state.monitor.on_step_threadsafe)
        state.engine, state.tokenizer = engine, tokenizer
        state.grammars = grammar_compiler(engine, tokenizer)
        info = state.info = engine.info
        state.status = "ready"
        log.info(
            "ready in %.1f s: %s (%s, %.0f MB) on %s (%s), %d KV blocks of %d tokens (%s), mode %s, speculative %s",
            time.perf_counter() - started,
            config.engine.model,
            info.weights,
            info.memory.loaded_bytes / 1e6,
            info.device,
            info.dtype,
            info.num_kv_blocks,
            info.block_size,
            info.kv_budget,
            engine.mode,
            info.speculative,
        )
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(engine_stopped.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        if engine_stopped.is_set() and not stop.is_set():
            # The engine cannot serve again (a lost device): exit non-zero so a supervisor restarts the daemon.
            state.status, state.load_error = "failed", engine.fatal_error
            log.critical("exiting: %s", engine.fatal_error or "the engine loop ended")
            await asyncio.sleep(0.2)  # let the error events reach their clients
            return 3
        await drain(state, config.shutdown_timeout)
        return 0
    finally:
        await runner.cleanup()
        if state.engine is not None:
            state.engine.shutdown()
        lock.release()
        log.info("stopped")


async def drain(state: DaemonState, timeout: float) -> None:
    """Refuse new requests, let in-flight ones finish for up to `timeout` s, then end the rest with an error."""
    state.status = "draining"
    engine = state.engine
    if engine is None:
        return
    log.info("draining: %d running, %d waiting (up to %.0f s)", engine.state.running, engine.state.waiting, timeout)
    deadline = time.monotonic() + timeout
    while not engine.idle and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if not engine.idle:
        log.warning("drain timeout: aborting the requests still in flight")
        engine.abort_all("the daemon is shutting down; the request was aborted after the drain timeout")
        for _ in range(100):
            if engine.idle:
                break
            await asyncio.sleep(0.02)
    await asyncio.sleep(0.1)  # let the last chunks reach their clients

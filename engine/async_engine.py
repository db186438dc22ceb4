"""AsyncEngine: an engine stepped on a background thread (a StepLoop), results to asyncio consumers.

The event loop never runs engine code: submissions and aborts go into an
inbox the engine thread drains at the start of each step, and outputs come
back with `loop.call_soon_threadsafe`. The thread sleeps on an Event when
there is nothing to do (no busy-wait) and wakes on a new request, an abort, or
the static scheduler's batch deadline.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import threading
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from minibatch.engine.core.admission import RequestRejected, check_capacity
from minibatch.engine.core.config import MODES
from minibatch.engine.core.engine import LLMEngine
from minibatch.engine.core.info import EngineInfo
from minibatch.engine.core.outputs import EngineState, RequestOutput, StepStats
from minibatch.engine.core.request import ImageSpan, Request
from minibatch.engine.core.sampling_params import SamplingParams
from minibatch.engine.heap import release_free_memory
from minibatch.engine.lora.names import LoraUses
from minibatch.engine.output_stream import OutputStream, RequestStream
from minibatch.engine.step_loop import StepLoop

log = logging.getLogger("minibatch.engine")

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread stopped; no request can run."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, stats_ring: int = 600) -> None:
        """The queue cap is the scheduler's `max_queue`, counted here over every request in flight."""
        self.engine = engine
        self._inflight = 0  # submitted and not yet given their final output
        self._count_lock = threading.Lock()
        self._inbox: deque[Callable[[], None]] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, OutputStream] = {}
        self._ids = itertools.count()
        self._queued = 0  # submitted but not yet in the scheduler's waiting queue
        self.stats: deque[StepStats] = deque(maxlen=stats_ring)
        self.stats_listeners: list[Callable[[StepStats], None]] = []  # called on the engine thread
        self.last_error: str | None = None
        self.last_error_time: float | None = None
        self.fatal_error: str | None = None  # set when the device is lost: the loop ends, the daemon exits
        self.started_at = time.time()
        self.loop_iterations = 0  # engine-thread wakeups; stays flat while idle (no busy-wait)
        self.block_map: dict = {"total": 0, "owners": {}, "shared": []}  # refreshed on the engine thread
        self._block_map_at = 0.0
        self._loop: StepLoop | None = None  # the thread that steps this engine, once bound
        self._worked = False  # stepped since the engine last ran out of work
        self._detached = threading.Event()  # the loop has let go of this engine
        self.on_detach: list[Callable[[], None]] = []  # called on the loop's thread when it lets go
        # The engine now, replaced (never mutated) by the engine thread: what other threads read.
        self.state: EngineState = engine.state()

    # -- lifecycle --------------------------------------------------------
    def start(self) -> None:
        """Step on a thread of this engine's own."""
        loop = StepLoop(private=True)
        loop.attach(self)
        loop.start()

    def run_on_this_thread(self, ready: Callable[[], None] = lambda: None) -> None:
        """Run the step loop on the calling thread until shutdown(); `ready()` is called once it counts as alive.

        For a thread that also built the model: OpenMP (libgomp) keeps a thread
        pool per thread that has run parallel work, and once a process holds
        more pool threads than cores it stops spinning between parallel
        regions; every small decode-step operation then pays a wake-up. Doing
        all tensor work on one thread keeps a single pool (measured on 2
        cores: a batch-1 decode step 86 ms on a second thread, 48 ms on one).
        """
        loop = StepLoop(private=True)
        loop.attach(self)
        loop.thread = threading.current_thread()
        ready()
        loop.run_here()

    def bind(self, loop: StepLoop) -> None:
        """Be stepped by `loop` (StepLoop.attach calls this)."""
        if self._loop is not None:
            raise RuntimeError("the engine is already bound to a step loop")
        self._loop, self._wake = loop, loop.wake

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop stepping; returns once the loop has let go (a private loop's thread has ended)."""
        self._stop.set()
        self._wake.set()
        if self._loop is None or self._loop.thread is threading.current_thread():
            return
        self._detached.wait(timeout)
        if self._loop.private and self._loop.thread.ident is not None:
            self._loop.thread.join(timeout)

    @property
    def _thread(self) -> threading.Thread | None:
        return self._loop.thread if self._loop is not None else None

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    @property
    def alive(self) -> bool:
        loop = self._loop
        return (
            self.fatal_error is None
            and loop is not None
            and loop.thread.is_alive()
            and not self._stop.is_set()
            and not self._detached.is_set()
        )

    def detached(self) -> None:
        """Called by the loop on its thread when it stops stepping this engine."""
        self.engine.close()  # (the disk tier's writes end before the engine is let go)
        self._detached.set()
        for fn in list(self.on_detach):
            fn()

    # -- requests ---------------------------------------------------------
    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        share_prompt_with: str | None = None,
        pooling: str | None = None,
        cache_salt: int = 0,
        reuse_shifted: bool = False,
        loras: LoraUses = (),
        images: tuple[ImageSpan, ...] = (),
    ) -> str:
        """Check and queue a request (from the event loop); raises RequestRejected or QueueFull at once.
        `pooling`: an embedding request, `cache_salt`: its prefix caches' namespace, `reuse_shifted`: it may
        start from a recent prompt's K/V at shifted positions, `loras`: the adapters it runs under, `images`: its
        prompt's images (LLMEngine.add_request)."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        request_id = request_id or f"req-{next(self._ids)}"
        sched = self.engine.scheduler
        probe = Request(request_id, list(prompt_token_ids), params, pooling=pooling)
        sched.check(probe)
        for name, _ in loras:
            self.engine.lora_digest(name)  # a 404 naming it, at once
        self.engine.check_images(images, len(prompt_token_ids))  # at once, as the checks above
        with self._count_lock:
            # Counted over every request in flight, those still in the inbox too, so the cap is
            # exact however fast the engine admits.
            check_capacity(sched.config, self._inflight)
            self._inflight += 1
        self._streams[request_id] = OutputStream(asyncio.get_running_loop())
        self._queued += 1

        def add() -> None:
            self._queued -= 1
            try:
                self.engine.add_request(
                    request_id,
                    prompt_token_ids,
                    params,
                    share_prompt_with,
                    checked=True,
                    pooling=pooling,
                    cache_salt=cache_salt,
                    reuse_shifted=reuse_shifted,
                    loras=loras,
                    images=images,
                )
            except RequestRejected as exc:
                self._emit(RequestOutput(request_id, "", [], True, "abort", error=str(exc)))

        self._inbox.append(add)
        self._wake.set()
        return request_id

    def stream(self, request_id: str, interval: float = 0.0) -> RequestStream:
        """Outputs of a submitted request until its final one (`interval` > 0: paced, see OutputStream).
        Closing or dropping the stream before then aborts the request, read or not (RequestStream)."""
        return RequestStream(
            request_id,
            self._streams[request_id].outputs(interval),
            lambda: self.abort(request_id),
            lambda: self._streams.pop(request_id, None),
        )

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        stream = self.stream(self.submit(prompt_token_ids, params, request_id))
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request's blocks are freed at the next step (a step computing for it alone stops at
        its next layer)."""
        self.engine.abort_soon(request_id)
        self._inbox.append(lambda: self.engine.abort(request_id))
        self._wake.set()

    def abort_all(self, error: str) -> None:
        """End every request with `error` (shutdown after the drain timeout)."""

        def fail() -> None:
            for out in self.engine.fail_all(error):
                self._emit(out)

        self._inbox.append(fail)
        self._wake.set()

    @property
    def info(self) -> EngineInfo | None:
        """The model's facts (static; made once at load)."""
        return self.engine.info

    @property
    def mode(self) -> str:
        """The batching mode in force now (a requested switch shows once it takes effect)."""
        return self.state.mode

    def timeline_since(self, step: int) -> tuple[int, int, list]:
        """(last step, capacity, the timeline's records after `step`), read under the timeline's lock."""
        timeline = self.engine.timeline
        return timeline.last_step, timeline.capacity, timeline.since(step)

    @property
    def idle(self) -> bool:
        return not self._inbox and self._queued == 0 and not self.engine.has_work()

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self._inbox.append(lambda: self.engine.set_mode(mode))
        self._wake.set()

    def call(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run `fn` on the engine thread between steps, in order with submissions and aborts (from the event
        loop); the future gets its result or its error. Queued at once: the call happens whether or not the
        future is awaited or cancelled."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def settle(result: T | None, error: BaseException | None) -> None:
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        def run() -> None:
            try:
                result, error = fn(), None
            except Exception as exc:
                result, error = None, exc
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:  # the loop is closed
                pass

        self._inbox.append(run)
        self._wake.set()
        return fut

    # -- the engine thread ------------------------------------------------
    def _refresh_block_map(self) -> None:
        """Which request holds which KV blocks (read by the daemon for the TUI's block map)."""
        bm = self.engine.scheduler.blocks
        owners = {rid: [b.block_id for b in blocks] for rid, blocks in bm.req_blocks.items()}
        shared = sorted({b.block_id for blocks in bm.req_blocks.values() for b in blocks if b.ref_count > 1})
        self.block_map = {
            "total": bm.num_usable_blocks,
            "block_size": bm.block_size,
            "owners": owners,
            "shared": shared,
            # the owners that are embeddings (prefill-only: their blocks go back when their prompt is done)
            "embeddings": sorted(
                rid for rid in owners if (r := self.engine.scheduler.requests.get(rid)) is not None and r.pooling
            ),
            "cached_free": sum(1 for b in bm.free_queue.values() if b.block_hash is not None),
            # the owners under LoRA adapters: their names, "+"-joined (the chat marks their blocks by them)
            "adapters": {
                rid: "+".join(n for n, _ in r.loras)
                for rid in owners
                if (r := self.engine.scheduler.requests.get(rid)) is not None and r.loras
            },
        }
        self._block_map_at = time.monotonic()

    @property
    def in_flight(self) -> int:
        return self._inflight

    def prompt_progress(self, request_id: str) -> float | None:
        """When a chunk of the request's prompt was last computed (time.monotonic, the event loop's clock), or
        None before its first chunk and once it has left the engine. Read from the event loop: one dict look-up
        and one attribute, which the step thread only ever replaces whole."""
        req = self.engine.scheduler.requests.get(request_id)
        return req.prompt_progress_time if req is not None else None

    def _emit(self, out: RequestOutput) -> None:
        if out.finished:
            with self._count_lock:
                self._inflight -= 1
        s = self._streams.get(out.request_id)
        if s is not None:
            try:
                s.loop.call_soon_threadsafe(s.put, out)
            except RuntimeError:  # the loop is closed
                pass

    def _drain_inbox(self) -> None:
        while self._inbox:
            self._inbox.popleft()()

    def turn(self) -> float | None:
        """One turn on the loop's thread: take in news, run a step when there is work. Returns None when it
        should be called again at once, else how long it may wait for news (inf: until woken)."""
        engine = self.engine
        self.loop_iterations += 1
        if self._inbox:
            self._drain_inbox()
            self.state = engine.state()
        if not engine.has_work():
            if self._worked:  # out of work: the forwards' freed temporaries go back to the OS
                release_free_memory()
                self._worked = False
                return None  # (news may have come in meanwhile: look again before sleeping)
            return math.inf
        self._worked = True
        try:
            outputs, stats = engine.step()
        except Exception as exc:  # the forward failed: fail in-flight requests, keep serving
            self.last_error = f"{type(exc).__name__}: {exc}"
            self.last_error_time = time.time()
            log.error("engine step failed: %s\n%s", self.last_error, traceback.format_exc())
            for out in engine.fail_all(f"engine error: {self.last_error}"):
                self._emit(out)
            self.state = engine.state()
            if engine.runner.device_lost():
                # A dead CUDA context fails every later step too: stop, so /health fails and the daemon exits.
                self.fatal_error = f"the device is lost after: {self.last_error}"
                log.critical("%s; the engine stops", self.fatal_error)
                self._drain_inbox()  # requests submitted meanwhile end too, never left waiting
                for out in engine.fail_all(f"engine error: {self.fatal_error}"):
                    self._emit(out)
            return None
        self.state = engine.state()
        if stats is not None:  # the step's record first: a client that has its answer finds the step behind it
            self.stats.append(stats)
            for listener in list(self.stats_listeners):
                listener(stats)
        for out in outputs:
            self._emit(out)
        if time.monotonic() - self._block_map_at > 0.2 or not engine.has_work():
            self._refresh_block_map()
        if stats is None and not outputs:
            # Nothing ran: wait for news or the static batch deadline.
            wakeup = engine.scheduler.next_wakeup()
            return math.inf if wakeup is None else max(0.0, wakeup - engine.clock())
        return None

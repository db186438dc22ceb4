"""StepLoop: one thread that steps every engine attached to it, one step each in turn.

Several loaded models share the device through one loop: their steps
alternate, never overlap. On CPU two engines stepping at once would run two
OpenMP teams on the same cores, and libgomp stops spinning between parallel
regions once a process holds more pool threads than cores, so every small
operation of a decode step pays a wake-up (AsyncEngine.run_on_this_thread
says what that costs); one thread keeps one team. Work that must run on that
thread — building a model, which fills the team's caches as a step does —
goes through `call`, between two rounds of steps. BENCHMARKS.md ("Several
models") measures this rule against a thread per engine.
"""

from __future__ import annotations

import logging
import math
import threading
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

log = logging.getLogger("minibatch.engine")


class Steppable(Protocol):
    """What the loop needs of an engine (AsyncEngine is one)."""

    fatal_error: str | None

    @property
    def stop_requested(self) -> bool: ...

    def bind(self, loop: StepLoop) -> None: ...

    def turn(self) -> float | None: ...

    def detached(self) -> None: ...


class StepLoop:
    def __init__(self, name: str = "minibatch-engine", private: bool = False) -> None:
        """`private`: the loop of one engine, which ends when that engine lets go of it."""
        self.wake = threading.Event()
        self.private = private
        self._engines: list[Steppable] = []
        self._jobs: deque[tuple[Callable[[], object], Future]] = deque()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.iterations = 0  # wakeups; flat while every engine is idle (no busy-wait)

    # -- from any thread ----------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def run_here(self) -> None:
        """Run the loop on the calling thread until stop() (or, private, until its engine stops)."""
        self.thread = threading.current_thread()
        self._run()

    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the loop's thread between two rounds of steps; the future gets its result."""
        fut: Future = Future()
        self._jobs.append((fn, fut))
        self.wake.set()
        return fut

    def attach(self, engine: Steppable) -> None:
        """Step `engine` from now on (it is stepped from the next round)."""
        engine.bind(self)
        self._jobs.append((lambda: self._engines.append(engine), Future()))
        self.wake.set()

    @property
    def engines(self) -> tuple[Steppable, ...]:
        return tuple(self._engines)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self._stop.is_set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.wake.set()
        if self.thread is not threading.current_thread() and self.thread.ident is not None:
            self.thread.join(timeout)

    # -- the loop's thread ----------------------------------------------------
    def _run_jobs(self) -> None:
        while self._jobs:
            fn, fut = self._jobs.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                if not isinstance(exc, Exception):
                    log.error("step loop job failed: %s", traceback.format_exc())
                fut.set_exception(exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.iterations += 1
            self.wake.clear()
            self._run_jobs()
            wait = self._round()
            if wait > 0 and not self._stop.is_set():
                self.wake.wait(None if wait == math.inf else wait)
        for engine in list(self._engines):
            self._detach(engine)
        while self._jobs:  # nobody is left waiting on a job
            _, fut = self._jobs.popleft()
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("the step loop has stopped"))

    def _round(self) -> float:
        """One turn of every engine; how long the loop may sleep. (A method of its own: a detached engine
        must not stay referenced from the loop's frame while it sleeps, or its memory is never freed.)"""
        wait = math.inf
        for engine in list(self._engines):
            if engine.stop_requested:
                self._detach(engine)
                continue
            w = engine.turn()
            if engine.fatal_error is not None:  # a lost device: this engine steps no more
                self._detach(engine)
                continue
            wait = 0.0 if w is None else min(wait, w)
        return wait

    def _detach(self, engine: Steppable) -> None:
        self._engines.remove(engine)
        engine.detached()
        if self.private and not self._engines:  # its one engine is gone: the thread ends
            self._stop.set()

"""One request's outputs on their way from the engine thread to the event loop that submitted it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from minibatch.engine.core.outputs import RequestOutput, merge_outputs


class OutputStream:
    """Filled on the event loop (`put`, called there by the engine thread with call_soon_threadsafe), read by
    the request's consumer (`outputs`)."""

    __slots__ = ("loop", "queue", "ended", "wake")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.ended = False  # the final output is in the queue
        self.wake: asyncio.Future | None = None  # a paced reader waiting out its interval

    def put(self, out: RequestOutput) -> None:
        self.queue.put_nowait(out)
        if out.finished:
            self.ended = True
            if self.wake is not None and not self.wake.done():
                self.wake.set_result(None)  # the end never waits for the interval

    async def outputs(self, interval: float = 0.0) -> AsyncIterator[RequestOutput]:
        """The outputs until the final one. `interval` > 0 paces them: after an output the next one comes
        no sooner than `interval` seconds later and holds every output that came meanwhile (merge_outputs).
        The first output and the final one never wait: a reader sees the first token and the end as they
        happen, and a client that draws text a few times a second reads a few outputs a second instead of
        one per engine step."""
        next_at = 0.0
        while True:
            if interval > 0 and not self.ended:
                wait = next_at - time.monotonic()
                if wait > 0:
                    self.wake = self.loop.create_future()
                    await asyncio.wait([self.wake], timeout=wait)
                    self.wake.cancel()
                    self.wake = None
            out = await self.queue.get()
            if interval > 0 and not out.finished and not self.queue.empty():
                held = [out]
                while not self.queue.empty() and not held[-1].finished:
                    held.append(self.queue.get_nowait())
                out = merge_outputs(held)
            yield out
            if out.finished:
                return
            next_at = time.monotonic() + interval


class RequestStream:
    """A submitted request's outputs until its final one (what AsyncEngine.stream returns). Closing it before
    the final output (`aclose`, being cancelled while waiting for an output, or being dropped) aborts the
    request, whether or not it was ever read: a handler cancelled between submitting and reading (a client
    gone before the first token) leaves nothing decoding and no stream behind."""

    __slots__ = ("request_id", "_outputs", "_abort", "_forget", "_open", "_finished")

    def __init__(
        self,
        request_id: str,
        outputs: AsyncIterator[RequestOutput],
        abort: Callable[[], None],
        forget: Callable[[], None],
    ) -> None:
        self.request_id = request_id
        self._outputs = outputs
        self._abort, self._forget = abort, forget  # abort: thread-safe; forget: drops the request's OutputStream
        self._open, self._finished = True, False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._open:
            raise StopAsyncIteration
        try:
            out = await self._outputs.__anext__()
        except BaseException:  # the end, or cancelled while waiting (a client gone, a timeout)
            self._end()
            raise
        if out.finished:
            self._finished = True
            self._end()
        return out

    def _end(self) -> None:
        if self._open:
            self._open = False
            if not self._finished:
                self._abort()
            self._forget()

    async def aclose(self) -> None:
        self._end()
        await self._outputs.aclose()

    def __del__(self) -> None:
        self._end()

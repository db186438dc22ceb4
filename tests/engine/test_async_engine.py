"""AsyncEngine with a fake runner: streaming across threads, aborts, rejection, faults, idle sleep."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from minibatch.engine.async_engine import AsyncEngine
from minibatch.engine.core.admission import QueueFull, RequestRejected
from minibatch.engine.core.block_manager import BlockManager
from minibatch.engine.core.config import SchedulerConfig
from minibatch.engine.core.engine import LLMEngine
from minibatch.engine.core.outputs import RequestOutput, merge_outputs
from minibatch.engine.core.sampling_params import SamplingParams

from .fakes import CharTokenizer, FakeRunner


class SlowRunner(FakeRunner):
    def __init__(self, block_size, delay=0.002, fail_at=None):
        super().__init__(block_size)
        self.delay, self.fail_at = delay, fail_at

    def execute(self, out):
        time.sleep(self.delay)
        if self.fail_at is not None and len(self.steps) + 1 == self.fail_at:
            self.steps.append(out)
            raise RuntimeError("injected fault")
        return super().execute(out)


def make_async(runner=None, queue=None, num_blocks=64, mode="continuous"):
    runner = runner or SlowRunner(4)
    engine = LLMEngine(
        runner, CharTokenizer(), BlockManager(num_blocks, 4), SchedulerConfig(4, 32, 256, 10.0, queue), (2,), mode
    )
    a = AsyncEngine(engine)
    a.start()
    return a


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


async def collect(a, prompt, n, **kw):
    outs = [o async for o in a.generate(prompt, greedy(n), **kw)]
    return outs


@pytest.mark.parametrize("mode", ["continuous", "static"])
def test_concurrent_streams_complete(mode):
    a = make_async(mode=mode)

    async def main():
        return await asyncio.gather(*(collect(a, [5 + i, 6, 7], 6 + i) for i in range(6)))

    try:
        results = asyncio.run(main())
        for i, outs in enumerate(results):
            assert outs[-1].finished and outs[-1].finish_reason == "length"
            assert sum(len(o.token_ids) for o in outs) == 6 + i
            assert outs[-1].metrics.output_tokens == 6 + i and outs[-1].metrics.ttft is not None
        assert a.stats and a.stats[-1].mode == mode
        assert a.engine.scheduler.blocks.num_used_blocks == 0
    finally:
        a.shutdown()


def test_leaving_the_stream_aborts_and_frees_blocks():
    a = make_async(SlowRunner(4, delay=0.01))

    async def main():
        gen = a.generate([5, 6, 7], greedy(200))
        async for out in gen:
            if out.token_ids:
                break
        await gen.aclose()
        for _ in range(200):
            await asyncio.sleep(0.01)
            if not a.engine.has_work():
                break

    try:
        asyncio.run(main())
        assert not a.engine.has_work() and a.engine.scheduler.blocks.num_used_blocks == 0
    finally:
        a.shutdown()


@pytest.mark.parametrize("how", ["closed", "dropped", "cancelled"])
def test_a_stream_left_before_its_first_output_aborts_the_request(how):
    """A handler that submits, then goes away before reading (its client left during the response's first
    event): closing the stream, dropping it unread, or being cancelled while waiting for the first output
    aborts the request within a step, frees its blocks and forgets its stream."""
    a = make_async(SlowRunner(4, delay=0.02))

    async def main():
        rid = a.submit([5, 6, 7], greedy(240))
        stream = a.stream(rid)
        if how == "closed":
            await stream.aclose()
        elif how == "dropped":
            del stream
        else:
            task = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0)  # waiting for the first output, which takes a step of 20 ms
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        for _ in range(200):
            await asyncio.sleep(0.01)
            if not a.engine.has_work():
                break
        return rid

    try:
        rid = asyncio.run(main())
        assert not a.engine.has_work() and a.engine.scheduler.blocks.num_used_blocks == 0
        assert rid not in a._streams and a._inflight == 0
        assert len(a.engine.runner.steps) < 20  # aborted at once, not decoded toward its 240 tokens
    finally:
        a.shutdown()


def test_rejection_and_queue_cap_are_immediate():
    a = make_async(SlowRunner(4, delay=0.05), queue=1)

    async def main():
        with pytest.raises(RequestRejected, match="context limit"):
            a.submit([5] * 300, greedy(4))
        # 4 run and 1 may wait: the 6th in flight is refused, however fast the engine admits
        for _ in range(5):
            a.submit([5, 6], greedy(50))
        a.submit([5, 6], greedy(50))

    try:
        with pytest.raises(QueueFull):
            asyncio.run(main())
    finally:
        a.shutdown()


def test_forward_fault_ends_streams_with_an_error_and_engine_keeps_serving():
    a = make_async(SlowRunner(4, fail_at=3))

    async def main():
        first = await asyncio.gather(collect(a, [5, 6], 20), collect(a, [7, 8], 20))
        after = await collect(a, [9, 10], 5)
        return first, after

    try:
        first, after = asyncio.run(main())
        for outs in first:
            assert outs[-1].finished and outs[-1].finish_reason == "abort" and "injected fault" in outs[-1].error
        assert after[-1].finish_reason == "length" and a.last_error and "injected fault" in a.last_error
        assert a.engine.scheduler.blocks.num_used_blocks == 0
    finally:
        a.shutdown()


class LostDeviceRunner(SlowRunner):
    def device_lost(self):
        return self.fail_at is not None and len(self.steps) >= self.fail_at


def test_a_lost_device_stops_the_engine_and_ends_every_request():
    from minibatch.engine.async_engine import EngineDeadError

    a = make_async(LostDeviceRunner(4, fail_at=3))

    async def main():
        return await asyncio.gather(collect(a, [5, 6], 20), collect(a, [7, 8], 20))

    try:
        for outs in asyncio.run(main()):
            assert outs[-1].finished and outs[-1].finish_reason == "abort" and "injected fault" in outs[-1].error
        a._thread.join(5)
        assert not a.alive and "the device is lost" in a.fatal_error
        assert a.engine.scheduler.blocks.num_used_blocks == 0
        with pytest.raises(EngineDeadError):
            a.submit([1, 2], greedy(3))
    finally:
        a.shutdown()


def test_idle_engine_sleeps():
    a = make_async()
    try:
        asyncio.run(collect(a, [5, 6], 3))
        time.sleep(0.05)
        before = a.loop_iterations
        time.sleep(0.3)
        assert a.loop_iterations == before
    finally:
        a.shutdown()


def test_run_on_this_thread_serves_on_the_callers_thread_and_shuts_down():
    import threading

    runner = SlowRunner(4)
    engine = LLMEngine(
        runner, CharTokenizer(), BlockManager(64, 4), SchedulerConfig(4, 32, 256, 10.0), (2,), "continuous"
    )
    a = AsyncEngine(engine)
    step_threads: set[str] = set()
    a.stats_listeners.append(lambda s: step_threads.add(threading.current_thread().name))
    ready = threading.Event()
    seen_alive = []
    t = threading.Thread(
        target=lambda: a.run_on_this_thread(ready=lambda: (seen_alive.append(a.alive), ready.set())),
        name="builder-and-engine",
        daemon=True,
    )
    t.start()
    assert ready.wait(5) and seen_alive == [True]
    try:
        outs = asyncio.run(collect(a, [5, 6, 7], 5))
        assert outs[-1].finished and sum(len(o.token_ids) for o in outs) == 5
        assert step_threads == {"builder-and-engine"}  # every step ran on the thread that called run_on_this_thread
    finally:
        a.shutdown()
    assert not t.is_alive() and not a.alive


def test_a_paced_stream_merges_what_came_within_its_interval():
    """interval > 0: at most one output per interval after the first; the same tokens and text in order."""
    a = make_async(SlowRunner(4, delay=0.002))

    async def run(interval):
        t0 = time.monotonic()
        rid = a.submit([5, 6, 7], greedy(120))
        outs = [o async for o in a.stream(rid, interval)]
        return outs, time.monotonic() - t0

    try:
        plain, _ = asyncio.run(run(0.0))
        paced, elapsed = asyncio.run(run(0.05))
        assert [t for o in paced for t in o.token_ids] == [t for o in plain for t in o.token_ids]
        assert "".join(o.text for o in paced) == "".join(o.text for o in plain)
        assert len(plain) >= 120  # a step's output each: one token a step
        assert paced[-1].finished and paced[-1].metrics.output_tokens == 120
        # the first output, then one per 50 ms at most (the end may come sooner than its interval)
        assert len(paced) <= 2 + elapsed / 0.05
        assert any(len(o.token_ids) > 1 for o in paced)
        assert a.engine.scheduler.blocks.num_used_blocks == 0
    finally:
        a.shutdown()


def test_the_end_of_a_paced_stream_does_not_wait_for_its_interval():
    a = make_async(SlowRunner(4, delay=0.002))

    async def run():
        t0 = time.monotonic()
        rid = a.submit([5, 6, 7], greedy(20))
        outs = [o async for o in a.stream(rid, 30.0)]
        return outs, time.monotonic() - t0

    try:
        outs, elapsed = asyncio.run(run())
        # the first output at once; the rest held, then sent the moment the request ends
        assert len(outs) <= 2 and sum(len(o.token_ids) for o in outs) == 20 and outs[-1].finished
        assert elapsed < 15.0  # far under the 30 s interval: the end woke the held stream
    finally:
        a.shutdown()


def test_merged_outputs_keep_each_tokens_logprob_and_the_last_end():
    first = RequestOutput("r", "a", [1], logprobs=[(-0.5, [(1, -0.5)])])
    mid = RequestOutput("r", "", [], logprobs=[])
    last = RequestOutput("r", "bc", [2, 3], True, "stop", logprobs=[(-0.1, []), (-0.2, [])])
    out = merge_outputs([first, mid, last])
    assert (out.text, out.token_ids, out.finished, out.finish_reason) == ("abc", [1, 2, 3], True, "stop")
    assert out.logprobs == [(-0.5, [(1, -0.5)]), (-0.1, []), (-0.2, [])]
    assert merge_outputs([first]) is first
    assert merge_outputs([RequestOutput("r", "x", [4]), RequestOutput("r", "y", [5])]).logprobs is None


def test_images_out_of_place_or_too_long_are_refused_at_submission():
    """(not on the engine thread, later, as an error output: at once, as the other checks)"""
    from minibatch.engine.core.admission import RequestRejected
    from minibatch.engine.core.request import ImageSpan

    a = make_async()  # steps of 32 tokens at most

    async def main():
        image = torch.zeros(8, 4)
        with pytest.raises(ValueError, match="within the prompt"):
            a.submit([5, 6, 7], greedy(2), images=(ImageSpan(1, image, 1),))
        with pytest.raises(RequestRejected, match="more positions than one step computes") as err:
            a.submit([5] * 50, greedy(2), images=(ImageSpan(2, torch.zeros(40, 4), 1, whole=True),))
        assert err.value.field == "images"
        return a.in_flight

    try:
        assert asyncio.run(main()) == 0
    finally:
        a.shutdown()

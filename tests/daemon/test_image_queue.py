"""Images waiting for the tower hold no thread of the shared executor: with more of them queued than that
executor has threads, other work off the event loop (a text request's template, a body's parse) still runs."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from minibatch.daemon.generation.images import ImageInput, encode_images
from minibatch.daemon.state import off_loop
from minibatch.engine.vision.images import ImageLimits


class SlowTower:
    """An ImageEncoder's seam: its own thread, and an encode that waits until released."""

    def __init__(self) -> None:
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="image-tower")
        self.limits = ImageLimits(8, 1 << 20, 1 << 20)
        self.release = threading.Event()
        self.encoded = 0

    def encode(self, data: bytes):
        self.release.wait(30)
        self.encoded += 1
        return data


def test_queued_images_leave_the_shared_executor_free():
    async def go():
        tower = SlowTower()
        waiting = (os.cpu_count() or 1) + 8  # more than the default executor's threads
        jobs = [
            asyncio.ensure_future(encode_images(tower, [ImageInput(f"images.{k}", b64="")], [b"x"]))
            for k in range(waiting)
        ]
        await asyncio.sleep(0.1)
        other = await asyncio.wait_for(off_loop(lambda: "rendered"), timeout=5)  # not behind the images
        assert tower.encoded == 0 and not any(j.done() for j in jobs)
        tower.release.set()
        done = await asyncio.gather(*jobs)
        tower.thread.shutdown()
        return other, done, tower.encoded

    other, done, encoded = asyncio.run(go())
    assert other == "rendered" and encoded == len(done) and all(d == [b"x"] for d in done)

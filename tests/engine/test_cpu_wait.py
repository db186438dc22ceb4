"""The engine's run-queue wait: zero-ish alone, large when another thread holds the only core it may use."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from minibatch.engine.core.cpu_wait import RunQueueWait

pytestmark = pytest.mark.skipif(not RunQueueWait().available, reason="no schedstat on this system")


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.solo  # "alone" means a core nothing else wants
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity")
def test_a_thread_sharing_its_core_waits_and_the_wait_is_counted():
    core = sorted(os.sched_getaffinity(0))[0]
    results: dict[str, float] = {}

    def engine() -> None:  # not the main thread, as in the daemon
        os.sched_setaffinity(0, {core})
        rq = RunQueueWait()
        start = rq.seconds()
        spin(0.3)  # alone on the core (the other thread is not started yet)
        results["alone"] = rq.seconds() - start
        # another process (not a thread: the GIL would take turns for the core) busy on the same core
        code = (
            f"import os, time\nos.sched_setaffinity(0, {{{core}}})\ne = time.time() + 1.0\nwhile time.time() < e: pass"
        )
        other = subprocess.Popen([sys.executable, "-c", code])
        time.sleep(0.2)  # it is up and spinning
        mid = rq.seconds()
        spin(0.6)  # two busy tasks on one core: this one waits about half the time
        results["shared"] = rq.seconds() - mid
        other.wait()

    t = threading.Thread(target=engine)
    t.start()
    t.join()
    assert results["alone"] < 0.1, results
    assert results["shared"] > 0.2, results  # ~0.6 s of the two threads' waits together


def test_the_main_thread_is_left_out_when_the_engine_runs_elsewhere():
    rq = RunQueueWait()
    rq.seconds()  # scans from this (main) thread: the main thread counts
    assert os.getpid() in rq.tids
    seen: list[list[int]] = []
    t = threading.Thread(target=lambda: (rq.seconds(), seen.append(list(rq.tids))))
    t.start()
    t.join()
    assert seen[0] and os.getpid() not in seen[0]  # the engine thread and the others, not the main one

"""release_free_memory hands the heap's freed pages back: glibc keeps them resident otherwise."""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

import psutil
import pytest

from minibatch.engine.heap import release_free_memory


def test_freed_heap_memory_leaves_the_resident_set():
    if not release_free_memory():
        pytest.skip("not glibc: nothing to trim")
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    proc, held = psutil.Process(), {}

    def churn() -> None:  # in a thread of its own, as the engine's: its own arena
        blocks = [libc.malloc(32 * 1024) for _ in range(4096)]  # 128 MB below the mmap threshold
        for b in blocks:
            ctypes.memset(b, 1, 32 * 1024)
        keep = blocks.pop()  # one live block at the top: free() alone cannot shrink the arena
        for b in blocks:
            libc.free(b)
        held["before"] = proc.memory_info().rss
        release_free_memory()
        held["after"] = proc.memory_info().rss
        libc.free(keep)

    t = threading.Thread(target=churn)
    t.start()
    t.join()
    assert held["before"] - held["after"] > 64 * 2**20, held

"""The disk tier of one engine (core/kv_tier.py's BlockTier): its identity's files in the shared folder.

Every block the prefix cache registers is offered to `save`: one not on disk yet is copied out of the pool
at once (on the engine's thread, before the step ends, so no later step can overwrite it first) and
written by a writer thread; the writer's backlog is bounded (past it a block is skipped and counted). A
request whose next blocks are on disk gets them read by a reader thread into the pool blocks the scheduler
gave it, while the engine steps the others; `poll` tells which reads ended and how many blocks came in
intact. Writes are write-through: what the pool registered is on disk whether the daemon is stopped, the
model unloaded or the process killed.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from minibatch.engine.core.kv_tier import BlockKey, TierCounters
from minibatch.engine.kv_offload.disk import PromptDiskCache

log = logging.getLogger("minibatch.prompt_cache")

MAX_BACKLOG_BYTES = 256 << 20  # blocks copied and waiting for the writer at most


class BlockIO(Protocol):
    """A pool block's bytes across every layer's K and V (runner/kv_cache.py's KVBlockIO)."""

    block_bytes: int

    def read(self, block_ids: Sequence[int]) -> list[memoryview]:
        """Copies of the blocks' contents, now (each a buffer of its own)."""

    def write(self, block_id: int, payload: memoryview) -> None:
        """Put a payload `read` made back into a block."""


WRITER_NICENESS = 19


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
    except (OSError, AttributeError):
        pass


class DiskTier:
    def __init__(self, cache: PromptDiskCache, identity: str, io: BlockIO, min_blocks: int) -> None:
        self.cache, self.identity, self.io = cache, identity, io
        self.min_blocks = min_blocks
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="minibatch-kv-read")
        # below the engine's threads: on a machine whose cores all compute, a write waits for a gap
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="minibatch-kv-write", initializer=_lower_priority)
        self._loads: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._backlog = 0  # bytes copied and not yet written
        self._queued: set[int] = set()  # hashes copied and not yet written
        self._c = TierCounters()
        self._closed = False

    def _count(self, **more: int) -> None:
        with self._lock:
            self._c = self._c._replace(**{k: getattr(self._c, k) + v for k, v in more.items()})

    def counters(self) -> TierCounters:
        return self._c

    # -- reading ----------------------------------------------------------
    def match(self, keys: Sequence[BlockKey]) -> int:
        n = 0
        for key in keys:
            if not self.cache.has(self.identity, key.hash):
                break
            n += 1
        return n

    def load(self, request_id: str, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> None:
        self._loads[request_id] = self._reader.submit(self._read, list(keys), list(block_ids))

    def _read(self, keys: list[BlockKey], block_ids: list[int]) -> int:
        n = 0
        try:
            for key, block_id in zip(keys, block_ids):
                payload = self.cache.read(self.identity, key, self.io.block_bytes)
                if payload is None:
                    self._count(bad_blocks=1)
                    break
                self.io.write(block_id, payload)
                n += 1
                self._count(read_blocks=1, read_bytes=len(payload))
        except Exception:  # a miss from here on, never a failed request
            log.exception("prompt cache: reading a block failed")
        return n

    def poll(self) -> list[tuple[str, int]]:
        done = [rid for rid, f in self._loads.items() if f.done()]
        return [(rid, self._loads.pop(rid).result()) for rid in done]

    # -- writing ----------------------------------------------------------
    def save(self, blocks: Sequence[tuple[BlockKey, int]]) -> None:
        if self._closed or not blocks:
            return
        todo = []
        for key, block_id in blocks:
            if self.cache.has(self.identity, key.hash):
                self.cache.touch(self.identity, key.hash)  # registered again: used again
            elif key.hash not in self._queued:
                todo.append((key, block_id))
        if not todo:
            return
        room = (MAX_BACKLOG_BYTES - self._backlog) // self.io.block_bytes
        if room < len(todo):
            self._count(skipped_blocks=len(todo) - max(room, 0))
            todo = todo[: max(room, 0)]
            if not todo:
                return
        payloads = self.io.read([b for _, b in todo])
        items = [(key, p) for (key, _), p in zip(todo, payloads)]
        with self._lock:
            self._backlog += len(items) * self.io.block_bytes
            self._queued.update(key.hash for key, _ in items)
        self._writer.submit(self._write, items)

    def _write(self, items: list[tuple[BlockKey, memoryview]]) -> None:
        for key, payload in items:
            try:
                written = self.cache.write(self.identity, key, payload)
                if written:
                    self._count(written_blocks=1, written_bytes=written)
            except OSError as exc:
                self._count(write_errors=1)
                self.cache.failed_write(exc)
            except Exception:
                self._count(write_errors=1)
                log.exception("prompt cache: writing a block failed")
            finally:
                with self._lock:
                    self._backlog -= self.io.block_bytes
                    self._queued.discard(key.hash)

    def flush(self) -> None:
        """Wait until every block copied so far is written (tests, and before a report)."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        """Finish the writes and reads under way (the model is unloading or the daemon stopping)."""
        self._closed = True
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)

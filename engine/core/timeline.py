"""The batch over time: which request held which row at each step, and what it computed there.

The engine's flat batch has no rows of its own, so the timeline gives each
request in the batch a row when it joins (the lowest free one) and keeps it
there until it leaves: finished, aborted or preempted. Static mode's finished
members keep their rows as padding until their batch ends; continuous mode
hands a freed row to the next request at once. Torch-free, like the scheduler.
"""

from __future__ import annotations

import heapq
import threading
from collections import deque
from dataclasses import dataclass

# Row states, one letter each in the compact form the API sends.
PREFILL, DECODE, PADDING, HELD = "p", "d", "x", "h"  # HELD: in the batch, but not computed this step (token budget)
VERIFIED = "v"  # a decoding row that verified a draft and took two or more tokens in the step
EMBED = "e"  # an embedding request's prompt chunk (it ends with its prompt: no decode follows)
IMAGE = "i"  # a prompt chunk that takes an image's embeddings (the vision tower's output enters the batch there)
STATES = {
    PREFILL: "prefill",
    IMAGE: "image",
    DECODE: "decode",
    VERIFIED: "verified",
    EMBED: "embedding",
    PADDING: "padding",
    HELD: "held",
}


@dataclass(slots=True, frozen=True)
class StepRecord:
    step: int
    time: float  # wall clock at the end of the step
    duration: float  # seconds
    mode: str  # "continuous" | "static"
    waiting: int  # requests in the waiting queue after the step
    # (row, request id, tokens computed, state, draft tokens verified, of them accepted); rows not listed are empty
    rows: tuple[tuple[int, str, int, str, int, int], ...]
    preempted: tuple[str, ...] = ()  # requests sent back to the queue this step
    adapters: tuple[tuple[str, str], ...] = ()  # (request id, its LoRA adapters' names, "+"-joined) of rows under any

    def as_dict(self) -> dict:
        return {
            "step": self.step,
            "t": round(self.time, 4),
            "ms": round(self.duration * 1e3, 3),
            "mode": self.mode,
            "waiting": self.waiting,
            "rows": [list(r) for r in self.rows],
            "preempted": list(self.preempted),
            "adapters": dict(self.adapters),
        }


class Timeline:
    """A ring of the last `capacity` step records, written by the engine thread, read by any thread."""

    def __init__(self, capacity: int = 512) -> None:
        if capacity < 1:
            raise ValueError(f"timeline capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._records: deque[StepRecord] = deque(maxlen=capacity)
        self._rows: dict[str, int] = {}  # request id -> its row while it is in the batch
        self._free: list[int] = []  # rows given back, reused lowest first
        self._next_row = 0
        self._lock = threading.Lock()

    def _row_for(self, request_id: str) -> int:
        row = self._rows.get(request_id)
        if row is None:
            if self._free:
                row = heapq.heappop(self._free)
            else:
                row, self._next_row = self._next_row, self._next_row + 1
            self._rows[request_id] = row
        return row

    def record(
        self,
        step: int,
        time: float,
        duration: float,
        mode: str,
        waiting: int,
        computed: list[tuple[str, int, bool, int, int]],
        padding: list[str],
        held: list[str],
        preempted: list[str],
        embeds: frozenset[str] | set[str] = frozenset(),
        adapters: dict[str, str] | None = None,
        images: frozenset[str] | set[str] = frozenset(),
    ) -> StepRecord:
        """computed: (request id, tokens, is a decode, draft tokens, accepted) in batch order; padding and
        held: request ids; preempted: ids; embeds: the computed requests that are embeddings; adapters: the
        LoRA adapters of the rows under any, by request id; images: the computed prompt chunks that take an
        image's positions."""
        members = {c[0] for c in computed} | set(padding) | set(held)
        for rid in [r for r in self._rows if r not in members]:  # left the batch: its row is free for the next one
            heapq.heappush(self._free, self._rows.pop(rid))

        def state(rid: str, decode: bool, accepted: int) -> str:
            if rid in embeds:
                return EMBED
            if decode:
                return VERIFIED if accepted else DECODE
            return IMAGE if rid in images else PREFILL

        rows = [
            (self._row_for(rid), rid, n, state(rid, decode, accepted), drafted, accepted)
            for rid, n, decode, drafted, accepted in computed
        ]
        rows += [(self._row_for(rid), rid, 1, PADDING, 0, 0) for rid in padding]
        rows += [(self._row_for(rid), rid, 0, HELD, 0, 0) for rid in held]
        rows.sort()
        under = tuple(sorted((rid, name) for rid, name in (adapters or {}).items() if rid in members))
        rec = StepRecord(step, time, duration, mode, waiting, tuple(rows), tuple(preempted), under)
        with self._lock:
            self._records.append(rec)
        return rec

    def since(self, step: int) -> list[StepRecord]:
        """The records after `step` (all that the ring still holds)."""
        with self._lock:
            records = list(self._records)
        return [r for r in records if r.step > step]

    @property
    def last_step(self) -> int:
        with self._lock:
            return self._records[-1].step if self._records else 0

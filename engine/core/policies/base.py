"""What a batching policy sees of the scheduler, and what it must answer.

A policy never holds the `Scheduler` class: it gets a `SchedulerView` (the queues, the block manager,
the limits, the clock, and the two moves a step makes while it is planned: admit and preempt, since
the blocks they free or take decide what fits next). Everything else it returns: `schedule` the step,
`on_finish` and `end` the requests whose blocks go back now, which the scheduler then releases.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

from minibatch.engine.core.block_manager import Block, BlockManager
from minibatch.engine.core.config import SchedulerConfig
from minibatch.engine.core.request import Request
from minibatch.engine.core.scheduler_output import SchedulerOutput


class SchedulerView(Protocol):
    config: SchedulerConfig
    blocks: BlockManager
    clock: Callable[[], float]
    waiting: deque[Request]
    running: list[Request]

    def admit(self, req: Request, computed_blocks: int) -> None:
        """Move the head of the queue into the running set, its first `computed_blocks` already cached (and the
        rows of the reuse `reusable` planned, once its blocks are allocated)."""

    def preempt(self, req: Request) -> None:
        """Free a running request's blocks and put it back at the head of the queue."""

    def reusable(self, req: Request, computed: list[Block]) -> int:
        """The positions the head of the queue holds before computing: its hits, then shifted reuse's rows."""

    def load_from_tier(self, req: Request, computed: list[Block]) -> bool:
        """Whether the head of the queue left it to wait for its next blocks from the second tier."""


class Policy(Protocol):
    reserves_blocks: bool  # blocks are reserved at admission for the whole request (none go back mid-way)

    def schedule(self, admit: bool = True) -> SchedulerOutput:
        """The next forward's work; `admit=False` while a mode switch waits for the batch to drain."""

    def on_finish(self, req: Request) -> list[Request]:
        """A running request finished: the requests whose blocks go back now."""

    def at_boundary(self) -> bool:
        """Whether the batching mode may switch now."""

    def end(self) -> list[Request]:
        """Leaving this mode: the requests whose blocks go back."""

    def next_wakeup(self) -> float | None:
        """When to schedule again though nothing arrives (a static batch's timeout)."""

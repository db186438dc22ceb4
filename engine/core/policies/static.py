"""Request-level (static) batching, as a plain `generate()` call does it.

A batch forms when max_num_seqs requests are waiting or the oldest has waited
max_wait_ms. Its members are prefilled together, then decoded in lock-step
until every member is done. A member that finishes early returns its result at
once, but its slot stays taken and its row keeps being computed (as a padded
row is) until the batch ends; nobody joins mid-batch. Blocks for prompt +
max_tokens are reserved at admission (as a padded KV cache would be), so a
static batch never needs preemption.
"""

from __future__ import annotations

from minibatch.engine.core.policies.base import SchedulerView
from minibatch.engine.core.request import Request
from minibatch.engine.core.scheduler_output import SchedulerOutput


class StaticPolicy:
    reserves_blocks = True  # prompt + max_tokens held from admission: a rejected draft's blocks stay

    def __init__(self, sched: SchedulerView) -> None:
        self.s = sched

    def schedule(self, admit: bool = True) -> SchedulerOutput:

        s, out = self.s, SchedulerOutput()
        if not s.running:
            if admit and self._ready():
                self._form_batch(out)
            return out
        for req in s.running:
            if req.status.finished:
                out.padding.append(req)
            else:  # its blocks were reserved for prompt + max_tokens, which a draft never passes
                n = req.num_to_compute
                out.add(req, n, req.draft_token_ids if n == 1 else None)
        return out

    def _ready(self) -> bool:
        s = self.s
        if not s.waiting:
            return False
        if len(s.waiting) >= s.config.max_num_seqs:
            return True
        return s.clock() - s.waiting[0].arrival_time >= s.config.max_wait_ms / 1000

    def _form_batch(self, out: SchedulerOutput) -> None:
        s = self.s
        while s.waiting and len(s.running) < s.config.max_num_seqs:
            req: Request = s.waiting[0]
            computed = s.blocks.get_computed_blocks(req)
            if s.load_from_tier(req, computed):
                continue  # it waits off the queue while its blocks come in
            s.reusable(req, computed)  # (its rows need the blocks reserved anyway)
            reserve = req.max_total_tokens - req.num_computed_tokens - len(computed) * s.blocks.block_size
            if not s.blocks.allocate(req, reserve, computed):
                break
            s.admit(req, len(computed))
            out.prefix_hit_blocks += len(computed)
            out.add(req, req.num_to_compute)

    def on_finish(self, req: Request) -> list[Request]:
        # It keeps its slot and blocks until the batch ends: when its last member finishes.
        return self.end() if self.at_boundary() else []

    def at_boundary(self) -> bool:
        return all(r.status.finished for r in self.s.running)

    def end(self) -> list[Request]:
        return list(self.s.running)  # the whole batch gives its slots and blocks back

    def next_wakeup(self) -> float | None:
        s = self.s
        if s.running or not s.waiting:
            return None
        return s.waiting[0].arrival_time + s.config.max_wait_ms / 1000

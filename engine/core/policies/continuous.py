"""Iteration-level (continuous) batching: requests join and leave the batch at every step."""

from __future__ import annotations

from minibatch.engine.core.policies.base import SchedulerView
from minibatch.engine.core.request import Request
from minibatch.engine.core.scheduler_output import SchedulerOutput


class ContinuousPolicy:
    """Each step: running requests first (decodes, then unfinished prefill chunks), then new ones.

    The token budget (max_num_batched_tokens) is shared, so a long prompt is
    prefilled in chunks alongside other requests' decodes. When the cache runs
    out of blocks, the most recently admitted request is preempted: its blocks
    are freed and it goes back to the head of the queue to be recomputed. With a
    sliding window on every layer, a running request's blocks that fell out of
    its window are handed back before it asks for more.
    """

    reserves_blocks = False  # blocks follow the computed tokens: a rejected draft's go back

    def __init__(self, sched: SchedulerView) -> None:
        self.s = sched

    def schedule(self, admit: bool = True) -> SchedulerOutput:

        s, out = self.s, SchedulerOutput()
        budget = s.config.max_num_batched_tokens
        # Decodes before prefill chunks, each group in admission order.
        order = sorted(s.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        for req in order:
            if req not in s.running:  # preempted earlier in this loop
                continue
            n = req.chunk(req.num_computed_tokens, min(req.num_to_compute, budget))
            if n <= 0:
                continue
            # a draft takes what the budget and the free blocks leave: it is dropped before anyone is preempted
            draft = req.draft_token_ids[: budget - n] if n == 1 else []
            out.released_blocks += s.blocks.release_out_of_window(req)
            if draft and not s.blocks.allocate(req, n + len(draft)):
                draft = []
            while not s.blocks.allocate(req, n):
                victim = s.running[-1]
                if victim in out.requests:
                    budget += out.remove(victim)
                s.preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.add(req, n, draft)
                budget -= n + len(draft)
        if admit and not out.preempted:
            self._admit(out, budget)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        s = self.s
        while s.waiting and budget > 0 and len(s.running) < s.config.max_num_seqs:
            req: Request = s.waiting[0]
            if req.prompt_leader is not None and s.blocks.leader_blocks(req) is None:
                break  # an n > 1 sibling waits (in order) until its leader has computed the shared prompt
            computed = s.blocks.get_computed_blocks(req)
            if s.load_from_tier(req, computed):
                continue  # it waits off the queue while its blocks come in
            start = s.reusable(req, computed)
            n = req.chunk(start, min(req.num_tokens - start, budget))
            if s.config.whole_prompts and n < req.num_tokens - start:
                break  # an encoder's input waits for a step with room for all of it
            if n <= 0:
                break  # a whole image it starts inside waits for a step with room for the rest of it
            if not s.blocks.allocate(req, start - len(computed) * s.blocks.block_size + n, computed):
                break
            s.admit(req, len(computed))
            # (up to its first held span; fewer rows copied fit too)
            n = req.chunk(req.num_computed_tokens, min(req.num_to_compute, budget))
            out.prefix_hit_blocks += len(computed)
            out.add(req, n)
            budget -= n

    def on_finish(self, req: Request) -> list[Request]:
        return [req]  # its slot and blocks go back at once

    def at_boundary(self) -> bool:
        return not self.s.running

    def end(self) -> list[Request]:
        return []  # at the boundary nothing is running

    def next_wakeup(self) -> float | None:
        return None

"""The scheduler: waiting and running queues over the block manager, with a switchable batching mode.

`schedule()` decides what the next forward computes; the policy that decides
is the current mode's (`ContinuousPolicy` or `StaticPolicy`, in policies/): it
sees the queues through the `SchedulerView` protocol, admits and preempts
through it, and returns what the step computes; which finished requests
give their blocks back it returns too, and the scheduler applies that. There is no
prefill or decode phase as such: each request's `num_computed_tokens` catches
up with its token count, a chunk at a time; a decode is a chunk of one.

Pure Python: no torch, so it is tested with a fake runner in milliseconds.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from minibatch.engine.core.admission import RequestRejected, check_capacity, check_request
from minibatch.engine.core.block_manager import Block, BlockManager
from minibatch.engine.core.config import MODES, SchedulerConfig
from minibatch.engine.core.kv_reuse import ReusePlan
from minibatch.engine.core.kv_tier import BlockKey, BlockTier
from minibatch.engine.core.policies.continuous import ContinuousPolicy
from minibatch.engine.core.policies.static import StaticPolicy
from minibatch.engine.core.request import Request, RequestStatus
from minibatch.engine.core.scheduler_output import SchedulerOutput

LOAD_POLL_S = 0.002  # how often an otherwise idle engine looks whether the tier's reads are in


class Scheduler:
    """Queues, admission checks, aborts and mode switching; `schedule()` defers to the mode's policy."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        mode: str = "continuous",
        clock: Callable[[], float] = time.monotonic,
        tier: BlockTier | None = None,
    ) -> None:

        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.config, self.blocks, self.clock = config, block_manager, clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order (static: the current batch)
        self.requests: dict[str, Request] = {}
        self.policies = {"continuous": ContinuousPolicy(self), "static": StaticPolicy(self)}
        self.mode = mode
        self.pending_mode: str | None = None
        self.num_preemptions = 0
        self.wasted_row_steps = 0
        self.tier = tier  # a second tier of prefix blocks (kv_tier.py); None: the pool's prefix cache only
        self.loading: dict[str, tuple[Request, list[BlockKey]]] = {}  # off the queue while its blocks come in
        self.tier_hit_blocks = 0  # blocks read back from the tier, over the scheduler's life
        self.plans: dict[str, ReusePlan] = {}  # shifted reuse planned for the queue's head, this schedule
        self.moves: list[tuple[int, int, int]] = []  # the rows this step copies (SchedulerOutput.kv_moves)
        self.reused_tokens = 0  # rows taken by shifted reuse, over the scheduler's life

    # -- requests in ------------------------------------------------------
    def check(self, req: Request) -> None:
        """Raise RequestRejected if the request could never run (see admission.check_request)."""
        check_request(req, self.config, self.blocks)

    def add(self, req: Request, checked: bool = False) -> None:
        """Queue a request; `checked`: the caller ran `check` and counted it against the queue cap already."""
        if req.request_id in self.requests:
            raise RequestRejected(f"request id {req.request_id!r} is already in use", "request_id", "duplicate_id")
        if not checked:
            self.check(req)
            check_capacity(self.config, len(self.requests))
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
        self.requests[req.request_id] = req

    # -- the step ---------------------------------------------------------
    def _switch_if_at_boundary(self) -> None:
        policy = self.policies[self.mode]
        if self.pending_mode is not None and policy.at_boundary():
            self._release_all(policy.end())
            self.mode, self.pending_mode = self.pending_mode, None

    def schedule(self) -> SchedulerOutput:
        self._switch_if_at_boundary()
        self.plans.clear()  # (a plan lives for one schedule; the engine unpins its sources after the step)
        loaded = self._finish_loads()
        out = self.policies[self.mode].schedule(admit=self.pending_mode is None)
        out.tier_hit_blocks = loaded
        out.kv_moves, self.moves = self.moves, []
        self.num_preemptions += len(out.preempted)
        self.wasted_row_steps += len(out.padding)
        return out

    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[tuple[Request, list[int]]]:
        """Advance computed tokens after the forward; return the requests that took tokens, with them.

        `sampled`: per request that reached its last token, the tokens it takes: for a verify row the
        accepted draft tokens and then the model's own next one. Its rejected draft positions are rolled
        back: they do not count as computed, and blocks that held only them go back to the pool (their
        stale K/V is overwritten before anything reads it) unless the policy reserved them (static). The
        prefix cache registers only blocks whose every token is verified (after the engine appended the
        tokens: `settle`).
        """
        taking = []
        for req, n, draft in zip(out.requests, out.num_new_tokens, out.drafts):
            tokens = sampled.get(req.request_id)
            rejected = len(draft) - (len(tokens) - 1) if draft and tokens else len(draft)
            req.advance(n - rejected)
            if rejected and not self.policies[self.mode].reserves_blocks:
                self.blocks.trim(req)
            if tokens is not None:
                taking.append((req, tokens))
            else:
                self.blocks.cache_full_blocks(req)
        return taking

    def settle(self, req: Request) -> None:
        """After the engine appended a row's tokens: register its newly completed blocks for prefix hits."""
        if not req.status.finished:
            self.blocks.cache_full_blocks(req)

    def next_wakeup(self) -> float | None:
        """When the scheduler wants to run again though nothing new arrives (static batch timeout, a load
        from the second tier to look at)."""
        wakeup = self.policies[self.mode].next_wakeup()
        if self.loading:
            soon = self.clock() + LOAD_POLL_S
            wakeup = soon if wakeup is None else min(wakeup, soon)
        return wakeup

    # -- shifted reuse ---------------------------------------------------------
    def reusable(self, req: Request, computed: list[Block]) -> int:
        """The positions the head of the queue holds before computing: its `computed` prefix hits, then the
        rows shifted reuse would copy (kv_reuse.py; its plan is taken by `admit`)."""
        start = len(computed) * self.blocks.block_size
        if self.config.cache_reuse <= 0 or not req.reuse_shifted:
            return start
        plan = self.blocks.plan_reuse(req, computed, self.config.cache_reuse, self.config.cache_reuse_settle)
        if plan is None:
            return start
        self.plans[req.request_id] = plan
        return plan.end

    # -- the second tier ----------------------------------------------------
    def load_from_tier(self, req: Request, computed: list[Block]) -> bool:
        """Whether the head of the queue leaves it to wait for its next blocks from the second tier.

        After the pool's own hits (`computed`), the tier is asked how many of the request's next full blocks
        it holds; a run of at least `tier.min_blocks` (that fits the free blocks) gets fresh blocks, held by
        the request with its hits, and the tier reads into them while the engine steps the others. Asked once
        per queueing: a request put back by a finished load, or one the tier had too little of, goes on."""
        tier, bm = self.tier, self.blocks
        if tier is None or req.tier_checked or req.prompt_leader is not None:
            return False
        req.tier_checked = True
        if not bm.enable_prefix_caching or req.computes_every_position:
            return False
        keys = list(bm.chain(req, len(computed), computed[-1].block_hash if computed else None))
        n = tier.match(keys) if keys else 0
        n = min(n, bm.num_free_blocks - sum(1 for b in computed if b.ref_count == 0))
        if n < max(1, tier.min_blocks) or not bm.allocate(req, n * bm.block_size, computed, hits=False):
            return False
        tier.load(req.request_id, keys[:n], req.block_ids[len(computed) :])
        self.waiting.remove(req)
        self.loading[req.request_id] = (req, keys[:n])
        return True

    def _finish_loads(self) -> int:
        """Requests whose blocks came in go back to the head of the queue: the blocks read intact are
        registered as prefix blocks and all of them freed, so the admission that follows finds them (they are
        the free queue's newest: the last to be handed out). Returns the blocks read."""
        if not self.loading:
            return 0
        read = 0
        for request_id, intact in self.tier.poll():
            req, keys = self.loading.pop(request_id)
            if not req.status.finished and intact:
                self.blocks.register_loaded(req, keys[:intact])
                read += intact
                if req.first_scheduled_time is None:
                    req.num_disk_cached_tokens = intact * self.blocks.block_size
            self.blocks.free(req)
            if req.status.finished:  # aborted while it waited: its blocks were held until the reads ended
                self.requests.pop(request_id, None)
            else:
                self.waiting.appendleft(req)
        self.tier_hit_blocks += read
        return read

    # -- requests out -----------------------------------------------------
    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request (stop, length or abort); the policy decides when its blocks go back."""
        if req.status.finished:
            return
        if req.request_id in self.loading:  # the tier is writing its blocks: they go back once it is done
            req.status, req.finished_time = status, self.clock()
            return
        if req in self.waiting:
            self.waiting.remove(req)
            self.blocks.free(req)
            self.requests.pop(req.request_id, None)
        req.status = status
        req.finished_time = self.clock()
        if req in self.running:
            if status != RequestStatus.FINISHED_ABORTED:
                # Its verified blocks stay findable by a later prompt once freed (a request that ends at its
                # first token has computed its whole prompt); an aborted one may have ended on a fault.
                self.blocks.cache_full_blocks(req)
            self._release_all(self.policies[self.mode].on_finish(req))
        self._switch_if_at_boundary()

    def _release_all(self, reqs: list[Request]) -> None:
        for req in reqs:
            self.release(req)

    def release(self, req: Request) -> None:
        """Drop a finished request from the running set and free its blocks."""
        self.running.remove(req)
        self.blocks.free(req)
        self.requests.pop(req.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def preempt(self, req: Request) -> None:
        """Free a running request's blocks and queue it first, to recompute its tokens later."""
        self.running.remove(req)
        self.blocks.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.held = []  # (its copied rows went with its blocks)
        req.num_preemptions += 1
        req.tier_checked = False
        self.waiting.appendleft(req)

    def admit(self, req: Request, computed_blocks: int) -> None:
        self.waiting.remove(req) if self.waiting[0] is not req else self.waiting.popleft()
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = computed_blocks * self.blocks.block_size
        plan = self.plans.pop(req.request_id, None)
        rows, spans = self.blocks.take_reuse(req, plan) if plan is not None else ([], [])
        req.held = spans
        req.advance(0)  # (a span that starts at its hits: held at once)
        self.moves += rows
        self.reused_tokens += len(rows)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = self.clock()
            req.num_cached_tokens = computed_blocks * self.blocks.block_size + len(rows)
            req.num_reused_tokens = len(rows)

    def set_mode(self, mode: str) -> None:
        """Switch at the next batch boundary; running requests are never dropped or restarted."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.pending_mode = None if mode == self.mode else mode
        self._switch_if_at_boundary()

    @property
    def num_unfinished(self) -> int:
        loading = sum(1 for r, _ in self.loading.values() if not r.status.finished)
        return len(self.waiting) + loading + sum(1 for r in self.running if not r.status.finished)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

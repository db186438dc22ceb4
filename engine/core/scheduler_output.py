"""What one engine step computes: the scheduler's answer, shared by both batching policies."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from minibatch.engine.core.request import Request


@dataclass(slots=True)
class SchedulerOutput:
    """What one forward computes. Lists are in batch order."""

    requests: list[Request] = field(default_factory=list)  # requests computing tokens this step
    num_new_tokens: list[int] = field(default_factory=list)  # tokens each computes: a prefill chunk, or 1 + its draft
    is_decode: list[bool] = field(default_factory=list)  # each computes its next token (not a prompt/recompute chunk)
    drafts: list[list[int]] = field(default_factory=list)  # speculative tokens each row verifies after its last one
    padding: list[Request] = field(default_factory=list)  # static: finished members whose rows still run
    preempted: list[Request] = field(default_factory=list)  # sent back to the waiting queue this step
    num_prefill_tokens: int = 0  # prompt (or recomputed) tokens in this forward
    num_decode_tokens: int = 0  # one per request generating its next token
    num_draft_tokens: int = 0  # speculative tokens verified beside them
    prefix_hit_blocks: int = 0  # blocks admitted requests took from the prefix cache
    tier_hit_blocks: int = 0  # blocks the second tier read back, registered before this schedule
    released_blocks: int = 0  # blocks handed back as out of every layer's sliding window
    # Rows copied before the forward (shifted reuse, kv_reuse.py): (source slot, slot, shift of K's position)
    kv_moves: list[tuple[int, int, int]] = field(default_factory=list)
    # Set by the engine: whether every request this step computes for has been aborted since (the forward then
    # stops at its next layer: outputs.StepAbandoned)
    abandon: Callable[[], bool] | None = None

    @property
    def is_empty(self) -> bool:
        return not self.requests and not self.padding

    def add(self, req: Request, n: int, draft: list[int] | None = None) -> None:
        """Row `req` computes its next `n` tokens, then verifies `draft` (a decoding row only)."""
        decode = bool(req.output_token_ids) and req.num_computed_tokens + n == req.num_tokens and n == 1
        draft = list(draft) if draft else []
        if draft and not decode:
            raise ValueError(f"request {req.request_id}: only a decoding row verifies a draft")
        self.requests.append(req)
        self.num_new_tokens.append(n + len(draft))
        self.is_decode.append(decode)
        self.drafts.append(draft)
        self.num_draft_tokens += len(draft)
        if decode:
            self.num_decode_tokens += 1
        else:
            self.num_prefill_tokens += n

    def remove(self, req: Request) -> int:
        """Take a row out again (its request was preempted); returns the tokens it had counted."""
        i = self.requests.index(req)
        n = self.num_new_tokens.pop(i)
        self.requests.pop(i)
        k = len(self.drafts.pop(i))
        self.num_draft_tokens -= k
        if self.is_decode.pop(i):
            self.num_decode_tokens -= 1
        else:
            self.num_prefill_tokens -= n
        return n

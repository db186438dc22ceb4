"""What one engine step computes: the scheduler's answer, shared by both batching policies."""

from __future__ import annotations

from dataclasses import dataclass, field

from minibatch.engine.core.request import Request


@dataclass(slots=True)
class SchedulerOutput:
    """What one forward computes. Lists are in batch order."""

    requests: list[Request] = field(default_factory=list)  # requests computing tokens this step
    num_new_tokens: list[int] = field(default_factory=list)  # tokens each computes: a prefill chunk, or 1
    is_decode: list[bool] = field(default_factory=list)  # each computes its next token (not a prompt/recompute chunk)
    padding: list[Request] = field(default_factory=list)  # static: finished members whose rows still run
    preempted: list[Request] = field(default_factory=list)  # sent back to the waiting queue this step
    num_prefill_tokens: int = 0  # prompt (or recomputed) tokens in this forward
    num_decode_tokens: int = 0  # one per request generating its next token
    prefix_hit_blocks: int = 0  # blocks admitted requests took from the prefix cache
    released_blocks: int = 0  # blocks handed back as out of every layer's sliding window

    @property
    def is_empty(self) -> bool:
        return not self.requests and not self.padding

    def add(self, req: Request, n: int) -> None:
        decode = bool(req.output_token_ids) and req.num_computed_tokens + n == req.num_tokens and n == 1
        self.requests.append(req)
        self.num_new_tokens.append(n)
        self.is_decode.append(decode)
        if decode:
            self.num_decode_tokens += 1
        else:
            self.num_prefill_tokens += n

    def remove(self, req: Request) -> int:
        i = self.requests.index(req)
        n = self.num_new_tokens.pop(i)
        self.requests.pop(i)
        if self.is_decode.pop(i):
            self.num_decode_tokens -= 1
        else:
            self.num_prefill_tokens -= n
        return n

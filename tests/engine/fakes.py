"""Fakes for one-part tests: a runner that needs no model and a character tokenizer."""

from __future__ import annotations

from minibatch.engine.core.outputs import RunnerOutput


class FakeRunner:
    """Checks what a real runner relies on, and 'samples' a token from the request's own history.

    The token depends only on the request's tokens, so a request gets the same
    output alone, in a batch, and after preemption and recompute. A verify row
    takes its draft while the draft matches what this rule would have produced,
    then the rule's own next token, as a real runner's greedy verify does.
    """

    def __init__(self, block_size: int, vocab: int = 50, window: int = 0) -> None:
        self.block_size, self.vocab, self.window = block_size, vocab, window
        self.steps: list = []

    def execute(self, out) -> RunnerOutput:
        self.steps.append(out)
        sampled = {}
        for req, n, draft in zip(out.requests, out.num_new_tokens, out.drafts):
            end = req.num_computed_tokens + n
            own = n - len(draft)
            assert 1 <= own and req.num_computed_tokens + own <= req.num_tokens
            assert not draft or (own == 1 and req.num_computed_tokens + 1 == req.num_tokens), "draft on a non-decode"
            assert len(req.block_ids) * self.block_size >= end, "blocks do not cover the chunk"
            # every block the chunk's queries see is the request's own; with a sliding window (on every
            # layer) the ones wholly before the first query's window may be the null block
            first = max(0, req.num_computed_tokens - self.window + 1) if self.window else 0
            assert 0 not in req.block_ids[first // self.block_size :], "a block the chunk attends to is the null block"
            if req.num_computed_tokens + own == req.num_tokens:
                history = req.tokens(0, req.num_tokens)
                tokens = [self.next_token(history)]
                for d in draft:
                    if tokens[-1] != d:
                        break
                    history.append(d)
                    tokens.append(self.next_token(history))
                sampled[req.request_id] = tokens
        return RunnerOutput(sampled)

    def device_lost(self) -> bool:
        return False

    def next_token(self, tokens: list[int]) -> int:
        return (sum(tokens) * 31 + len(tokens)) % self.vocab + 3

    def forget(self, request_id: str) -> None:
        pass


class CharTokenizer:
    """Token id i decodes to one letter; ids below 3 are special (skipped)."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + (i - 3) % 26) for i in ids if i >= 3 or not skip_special_tokens)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

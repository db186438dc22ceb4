"""The engine's speculative decoder: per-request n-gram indexes and acceptance, the step-cost fit, the counts.

Before each schedule the engine asks it for drafts (`propose`): each request about to decode gets
`draft_token_ids` of the length `draft_length.draft_depth` allows (cut where its grammar would refuse
a token, and so that max_tokens is never exceeded). After the step the engine reports what each verify
kept (`observe`) and how long the step took for how many tokens (`observe_step`).
"""

from __future__ import annotations

from typing import Protocol

from minibatch.engine.core.request import Request
from minibatch.engine.spec_decode.config import SpecConfig
from minibatch.engine.spec_decode.draft_length import (
    ENGINE_DECAY,
    PROBE_EVERY,
    STOP_BELOW,
    Acceptance,
    Draft,
    StepCost,
    draft_depth,
)
from minibatch.engine.spec_decode.ngram import NgramProposer


class Proposer(Protocol):
    """Drafts for a few requests at once (ngram.NgramProposer, draft_model.DraftModelProposer)."""

    def propose(self, reqs: list[Request], ks: list[int]) -> list[Draft]:
        """Up to ks[i] tokens to follow each request's tokens (a point mass each: one guess per position),
        each with its source."""

    def forget(self, request_id: str) -> None:
        """The request is done: drop what the proposer kept for it."""


class SpecDecoder:
    def __init__(self, config: SpecConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        self.proposer = proposer or NgramProposer(config.ngram_min, config.ngram_max)
        self.cost = StepCost()
        self._acceptance: dict[str, Acceptance] = {}
        self.engine_acceptance = Acceptance()  # over every request's verifies: where a new request starts
        self.sources: dict[str, Acceptance] = {}  # per draft source (Draft.source), engine-wide
        self._source_of: dict[str, str] = {}  # request id -> the source of the draft it verifies next
        self.drafted = 0  # draft tokens verified, over the engine's life
        self.accepted = 0  # of them accepted
        self.verify_rows = 0  # rows that verified at least one draft token

    def propose(self, running: list[Request]) -> None:
        """Set `draft_token_ids` on every running request that decodes next and may speculate."""
        ready = [r for r in running if not r.status.finished and r.num_tokens - r.num_computed_tokens == 1]
        rows = len(ready)
        asking, ks, probes = [], [], set()
        for req in ready:
            req.draft_token_ids = []
            if not req.params.speculative or not req.output_token_ids:
                continue
            acc = self._acceptance.get(req.request_id)
            if acc is None:
                acc = self._acceptance[req.request_id] = Acceptance.starting_at(self.engine_acceptance.rate)
            k = 0 if acc.rate < STOP_BELOW else draft_depth(acc.rate, rows, self.cost, self.config.num_tokens)
            if k == 0:
                # Failing, or not worth a row at this batch size. A failing request (or one that has not
                # verified yet) tries one token now and then, to learn whether it still fails; one that
                # accepts well but whose drafts the batch refuses has nothing to learn: the batch decides
                # (its probes were one row in 16 more in a compute-bound step: 0.89x at 64 chats).
                acc.idle_steps += 1
                if acc.idle_steps < PROBE_EVERY or (acc.verified and acc.rate >= STOP_BELOW):
                    continue
                k = 1
                probes.add(req.request_id)
            acc.idle_steps = 0
            k = min(k, req.params.max_tokens - len(req.output_token_ids) - 1)
            if k > 0:
                asking.append(req)
                ks.append(k)
        if not asking:
            return
        for req, draft in zip(asking, self.proposer.propose(asking, ks)):
            tokens = draft.tokens
            if tokens and req.request_id not in probes:  # a probe learns the request's rate: never cut
                source = self.sources.get(draft.source)
                if source is None:
                    source = self.sources[draft.source] = Acceptance()
                tokens = tokens[: draft_depth(source.rate, rows, self.cost, len(tokens))]
            grammar = req.params.grammar
            if tokens and grammar is not None:
                tokens = tokens[: grammar.validate(tokens)]
            req.draft_token_ids = tokens
            self._source_of[req.request_id] = draft.source

    def observe(self, req: Request, drafted: int, accepted: int) -> None:
        """A verify row kept `accepted` of its `drafted` tokens."""
        if drafted <= 0:
            return
        self.drafted += drafted
        self.accepted += accepted
        self.verify_rows += 1
        req.num_draft_tokens += drafted
        req.num_accepted_tokens += accepted
        acc = self._acceptance.get(req.request_id)
        if acc is not None:
            acc.observe(drafted, accepted)
        self.engine_acceptance.observe(drafted, accepted, ENGINE_DECAY)
        source = self.sources.get(self._source_of.get(req.request_id, ""))
        if source is not None:
            source.observe(drafted, accepted, ENGINE_DECAY)

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A step that computed only decode and verify rows: `tokens` of them in `seconds`."""
        self.cost.observe(tokens, seconds)

    def forget(self, request_id: str) -> None:
        self._acceptance.pop(request_id, None)
        self._source_of.pop(request_id, None)
        self.proposer.forget(request_id)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

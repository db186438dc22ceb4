"""The engine's speculative decoder: per-request n-gram indexes and acceptance, the step-cost fit, the counts.

Before each schedule the engine asks it for drafts (`propose`): each request about to decode gets
`draft_token_ids` of the length `draft_length.draft_depth` allows (cut where its grammar would refuse
a token, and so that max_tokens is never exceeded). After the step the engine reports what each verify
kept (`observe`) and how long the step took for how many tokens (`observe_step`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minibatch.engine.core.request import Request
from minibatch.engine.spec_decode.config import SpecConfig
from minibatch.engine.spec_decode.draft_length import PROBE_EVERY, STOP_BELOW, Acceptance, StepCost, draft_depth
from minibatch.engine.spec_decode.ngram import NgramIndex


@dataclass(slots=True)
class _Row:
    index: NgramIndex
    acceptance: Acceptance = field(default_factory=Acceptance)


class SpecDecoder:
    def __init__(self, config: SpecConfig) -> None:
        self.config = config
        self.cost = StepCost()
        self._rows: dict[str, _Row] = {}
        self.drafted = 0  # draft tokens verified, over the engine's life
        self.accepted = 0  # of them accepted
        self.verify_rows = 0  # rows that verified at least one draft token

    def propose(self, running: list[Request]) -> None:
        """Set `draft_token_ids` on every running request that decodes next and may speculate."""
        ready = [r for r in running if not r.status.finished and r.num_tokens - r.num_computed_tokens == 1]
        rows = len(ready)
        for req in ready:
            req.draft_token_ids = []
            if not req.params.speculative or not req.output_token_ids:
                continue
            row = self._row(req)
            acc = row.acceptance
            if acc.rate < STOP_BELOW:  # it keeps failing: no drafts, but try one now and then
                acc.idle_steps += 1
                if acc.idle_steps < PROBE_EVERY:
                    continue
                acc.idle_steps, k = 0, 1
            else:
                k = draft_depth(acc.rate, rows, self.cost, self.config.num_tokens)
            k = min(k, req.params.max_tokens - len(req.output_token_ids) - 1)
            if k <= 0:
                continue
            draft = row.index.propose(k)
            grammar = req.params.grammar
            if draft and grammar is not None:
                draft = draft[: grammar.validate(draft)]
            req.draft_token_ids = draft

    def _row(self, req: Request) -> _Row:
        row = self._rows.get(req.request_id)
        if row is None:
            row = self._rows[req.request_id] = _Row(NgramIndex(self.config.ngram_min, self.config.ngram_max))
            row.index.extend(req.prompt_token_ids)
        have = len(row.index.tokens) - req.num_prompt_tokens
        if have < len(req.output_token_ids):
            row.index.extend(req.output_token_ids[have:])
        return row

    def observe(self, req: Request, drafted: int, accepted: int) -> None:
        """A verify row kept `accepted` of its `drafted` tokens."""
        if drafted <= 0:
            return
        self.drafted += drafted
        self.accepted += accepted
        self.verify_rows += 1
        req.num_draft_tokens += drafted
        req.num_accepted_tokens += accepted
        row = self._rows.get(req.request_id)
        if row is not None:
            row.acceptance.observe(drafted, accepted)

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A step that computed only decode and verify rows: `tokens` of them in `seconds`."""
        self.cost.observe(tokens, seconds)

    def forget(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

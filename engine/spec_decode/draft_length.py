"""How many draft tokens each row gets this step: only those expected to pay for the rows they add.

A step's time grows about linearly with the tokens it computes: t(T) = fixed + per_token * T. On a
memory-bound step (few rows: the weights are read once whatever the row count) `per_token` is small
beside `fixed`, and a verify row is nearly free; as the batch grows the step becomes compute-bound and
every extra row costs almost what a decode row does. A draft token at depth j (the j-th of its row) is
kept only when it is accepted with probability a^j (a: that request's recent per-token acceptance; a
new request starts from the engine's recent rate) and that expected token is worth its row:

    a^j * t(T) / B  >=  per_token          (B decoding rows: a step's time buys B tokens)

so the depth bound is j <= log(per_token * B / t(T)) / log(a). Two rates bound a draft: its request's
(what the request is: a copy-heavy answer accepts far more than a chat) and its source's (what found the
draft: over the built-in model's copy-heavy prompts a 4-token n-gram match was followed to the end of
its draft in 11 of 16 drafts of 8, and never rejected at once, where a 1-token match was rejected at its
first token in two of three; chat prompts alike). Each source's rate is learnt engine-wide. `StepCost` fits `fixed` and
`per_token` online from the engine's own decode steps (a least-squares line over the last steps, with a
prior until the steps vary enough), so the rule follows the machine and the model it runs on.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

PRIOR_FIXED_S = 5e-3  # a small model's batch-1 step on a CPU, until the engine has measured its own
PRIOR_PER_TOKEN_S = 3e-4
COST_WINDOW = 256  # decode steps the fit looks at
REFIT_EVERY = 16  # decode steps between fits
MIN_SPREAD = 4  # the token counts seen must span this many before the fit replaces the prior
ACCEPT_PRIOR = (3.0, 1.0)  # pseudo-counts (accepted, rejected): the engine's first requests start at a = 0.75
PRIOR_WEIGHT = 2.0  # a later request starts at the engine's recent rate, worth this many observations
ACCEPT_DECAY = 0.9  # per observation: acceptance follows the request's recent drafts
ENGINE_DECAY = 0.99  # the engine-wide rates (all drafts', and each source's): the last hundred or so verifies
STOP_BELOW = 0.2  # a request accepting less than this stops speculating ...
PROBE_EVERY = 16  # ... and tries one draft token after this many steps, to see whether it still fails


class StepCost:
    """t(T) = fixed + per_token * T, fitted to the decode steps the engine reports."""

    def __init__(self, fixed: float = PRIOR_FIXED_S, per_token: float = PRIOR_PER_TOKEN_S) -> None:
        self.prior = (fixed, per_token)
        self.fixed, self.per_token = fixed, per_token
        self._obs: deque[tuple[int, float]] = deque(maxlen=COST_WINDOW)
        self._seen = 0  # observations ever (the window's length stops at COST_WINDOW)

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not seconds > 0:
            return
        self._obs.append((tokens, seconds))
        self._seen += 1
        if self._seen % REFIT_EVERY == 0:  # a fit walks the whole window: not every step
            self._fit()

    def _fit(self) -> None:
        xs = [t for t, _ in self._obs]
        if max(xs) - min(xs) < MIN_SPREAD:
            return
        n = len(xs)
        mx = sum(xs) / n
        my = sum(s for _, s in self._obs) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        sxy = sum((x - mx) * (s - my) for x, s in self._obs)
        slope = max(sxy / sxx, 1e-6)
        self.per_token, self.fixed = slope, max(my - slope * mx, slope)

    def at(self, tokens: int) -> float:
        return self.fixed + self.per_token * tokens


@dataclass(slots=True)
class Draft:
    """Proposed tokens and what found them (e.g. "ngram4", "edit", "model"): acceptance is learnt per
    source, and a draft is cut to the depth its source's rate pays for."""

    tokens: list[int]
    source: str


@dataclass(slots=True)
class Acceptance:
    """A request's recent per-token acceptance: decayed counts of accepted and rejected draft tokens."""

    accepted: float = ACCEPT_PRIOR[0]
    rejected: float = ACCEPT_PRIOR[1]
    idle_steps: int = 0  # steps since it last drafted while stopped
    verified: bool = False  # it has verified a draft: its rate is its own, not only the prior

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    @classmethod
    def starting_at(cls, rate: float) -> Acceptance:
        """A new request's: the engine's recent rate (a workload's requests draft alike), as PRIOR_WEIGHT
        observations, so its own first verifies soon outweigh it; where that rate gives no draft, its first
        decode still verifies one token (a probe), so a copy-heavy request among chats shows what it is."""
        return cls(rate * PRIOR_WEIGHT, (1 - rate) * PRIOR_WEIGHT, idle_steps=PROBE_EVERY)  # it probes at once

    def observe(self, drafted: int, accepted: int, decay: float = ACCEPT_DECAY) -> None:
        """One verify: `accepted` of `drafted` tokens kept (a run stops at its first rejection), so the
        per-token rate's estimate is accepted tokens over accepted tokens plus rejections."""
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + (1 if accepted < drafted else 0)
        self.verified = True


def draft_depth(rate: float, rows: int, cost: StepCost, k_max: int) -> int:
    """The deepest draft token worth its row for a request accepting `rate` per token, in a step of
    `rows` decoding rows (the module docstring's rule)."""
    if k_max <= 0 or rate <= 0.0:
        return 0
    threshold = cost.per_token * rows / cost.at(rows)
    if threshold >= 1.0:
        return 0
    if rate >= 1.0:
        return k_max
    return max(0, min(k_max, int(math.log(threshold) / math.log(rate))))

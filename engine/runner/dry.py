"""DRY ("don't repeat yourself", as llama-server and koboldcpp define it): a token that would extend a
repeat of earlier text is penalised, the more the longer the repeat.

For the last token of the context (the prompt and the output, or their last `dry_penalty_last_n` tokens),
each earlier place where the same token stands is matched backwards against the context's end: the match
length L is how many tokens before and at that place equal the context's last L tokens, none of them a
sequence breaker. The token that followed that place would make the repeat L + 1 long; when L is at least
`dry_allowed_length` its logit loses multiplier x base^(L - allowed_length) (the largest such penalty over its
places). A sequence breaker is a token whose text contains one of the request's breaker strings: no repeat
spans one, and a breaker is never penalised (llama.cpp also matches a breaker string spread over several
tokens; here it must sit within one token). Matches are followed back at most MAX_MATCH tokens: by then the
penalty has long dwarfed any logit.
"""

from __future__ import annotations

import numpy as np

from minibatch.engine.core.sampling_params import SamplingParams

MAX_MATCH = 64


def breaker_mask(texts: list[str], breakers: list[str]) -> np.ndarray:
    """bool [vocab]: the tokens whose text contains one of `breakers`."""
    return np.fromiter((any(b in t for b in breakers) for t in texts), dtype=bool, count=len(texts))


def dry_penalties(context: np.ndarray, breaker: np.ndarray | None, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, the penalty to subtract from each) for a row whose tokens so far are `context` (int64);
    `breaker`: bool [vocab], or None for no breakers."""
    none = np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float64)
    ctx = context if p.dry_penalty_last_n < 0 else context[-p.dry_penalty_last_n :]
    if len(ctx) < 2:
        return none
    stop = np.zeros(len(ctx), dtype=bool) if breaker is None else _lookup(breaker, ctx)
    if stop[-1]:
        return none
    end = len(ctx) - 1
    places = np.flatnonzero(ctx[:-1] == ctx[-1])  # where the last token stood before
    places = places[~stop[places + 1]] if len(places) else places  # what followed it: never a breaker
    length = np.ones(len(places), dtype=np.int64)
    alive = np.arange(len(places))
    for s in range(1, MAX_MATCH):
        if not len(alive) or stop[end - s] or end - s <= 0:
            break
        at = places[alive] - s
        ok = (at >= 0) & (ctx[np.maximum(at, 0)] == ctx[end - s])
        alive = alive[ok]
        length[alive] += 1
    hit = length >= p.dry_allowed_length
    if not hit.any():
        return none
    tokens = ctx[places[hit] + 1]
    penalty = p.dry_multiplier * p.dry_base ** (length[hit] - p.dry_allowed_length).astype(np.float64)
    order = np.lexsort((-penalty, tokens))  # per token, its largest penalty first
    tokens, penalty = tokens[order], penalty[order]
    first = np.r_[True, tokens[1:] != tokens[:-1]]
    return tokens[first], penalty[first]


def _lookup(breaker: np.ndarray, ids: np.ndarray) -> np.ndarray:
    inside = ids < len(breaker)
    out = np.zeros(len(ids), dtype=bool)
    out[inside] = breaker[ids[inside]]
    return out

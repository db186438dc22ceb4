"""Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's own suffix.

Copy-heavy answers (edit this paragraph, extract these fields, continue this list) repeat long runs of
their prompt; when the last n tokens appeared before, what came after them there is a good guess for
what comes next. No second model: one dictionary lookup per suffix length per step.
"""

from __future__ import annotations

from minibatch.engine.core.request import Request
from minibatch.engine.spec_decode.draft_length import Draft


class NgramIndex:
    """One sequence's n-grams (n in [n_min, n_max]) -> the position just after their latest occurrence.

    Grows as tokens are appended (`extend`); the occurrence ending at the current end is added only after
    the lookup, so a suffix never matches itself.
    """

    __slots__ = ("n_min", "n_max", "tokens", "source", "_last", "_prev", "_indexed")

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self.source = "none"  # what found the last proposal: "ngram<n>" (the suffix length matched) or "edit"
        self._last: dict[tuple[int, ...], int] = {}
        self._prev: dict[tuple[int, ...], int] = {}  # the occurrence before the latest
        self._indexed = 0  # n-grams ending before this position are in _last

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def _index_upto(self, end: int) -> None:
        """Record every n-gram that ends before position `end` (exclusive), as its latest occurrence."""
        toks, last, prev = self.tokens, self._last, self._prev
        for stop in range(self._indexed, end):  # n-grams toks[stop-n+1 : stop+1], followed by position stop+1
            for n in range(self.n_min, min(self.n_max, stop + 1) + 1):
                key = tuple(toks[stop - n + 1 : stop + 1])
                if key in last:
                    prev[key] = last[key]
                last[key] = stop + 1
        self._indexed = max(self._indexed, end)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix seen earlier (longest n first); [] when none."""
        toks = self.tokens
        end = len(toks)
        self.source = "none"
        if k <= 0 or end < self.n_min + 1:
            return []
        self._index_upto(end - 1)  # occurrences ending before the last token: the suffix itself excluded
        for n in range(min(self.n_max, end - 1), self.n_min - 1, -1):
            after = self._last.get(tuple(toks[end - n :]))
            if after is not None:
                self.source = f"ngram{n}"
                return toks[after : min(after + k, end)]
        return self._past_an_edit(k)

    def _past_an_edit(self, k: int) -> list[int]:
        """No suffix occurred before: maybe the last `s` tokens (1 or 2) replaced as many of an earlier
        run, as where an edited copy fixes a word. The n tokens before them (n >= 2) found earlier, what
        followed that occurrence `s` tokens on is the guess."""
        toks, end = self.tokens, len(self.tokens)
        for s in (1, 2):
            for n in range(min(self.n_max, end - s - 1), max(self.n_min, 2) - 1, -1):
                key = tuple(toks[end - s - n : end - s])
                after = self._last.get(key)
                if after == end - s:  # that is the run itself: the occurrence before it
                    after = self._prev.get(key)
                if after is not None and after + s < end - s - n:
                    self.source = "edit"
                    return toks[after + s : min(after + s + k, end - s - n)]
        return []


class NgramProposer:
    """Prompt lookup for every speculating request: one NgramIndex each, grown as its output grows."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self._index: dict[str, NgramIndex] = {}

    def propose(self, reqs: list[Request], ks: list[int]) -> list[Draft]:
        out = []
        for req, k in zip(reqs, ks):
            index = self._index.get(req.request_id)
            if index is None:
                index = self._index[req.request_id] = NgramIndex(self.n_min, self.n_max)
                index.extend(req.prompt_token_ids)
            have = len(index.tokens) - req.num_prompt_tokens
            if have < len(req.output_token_ids):
                index.extend(req.output_token_ids[have:])
            tokens = index.propose(k)
            out.append(Draft(tokens, index.source))
        return out

    def forget(self, request_id: str) -> None:
        self._index.pop(request_id, None)

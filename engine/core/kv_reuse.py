"""Reusing a previous prompt's K/V at shifted positions (llama-server's `--cache-reuse`). Pure Python.

An editor asks for a completion at each pause in typing, and the window of code it sends slides with the
cursor: lines leave the top of the prefix, so most of the new prompt is the old one's tokens at positions a
few dozen lower. The prefix cache finds only an identical start. Here a request that allows it (a
fill-in-the-middle request: `Request.reuse_shifted`) takes, after its prefix hits, runs of a recent prompt's
tokens that appear again in its own, each at least `min_run` long, found as llama-server finds them: from
where the two prompts part, the first later place in the old prompt where a long enough run of the new
one's next tokens starts (the old rows skipped are deleted tokens). Unlike llama-server, a new token that starts
no run (a typed word) is computed and the walk goes on, so the code after it is reused too; and each run after
a change starts a few tokens in (`settle`): the tokens right after it are computed, not moved.

The engine copies those rows into the request's own blocks, K rotated by each run's shift (rotary
embeddings compose: rotating a key made at position p by the angle of d gives the key at p + d, up to one
more rounding; engine/runner/kv_shift.py), V as it is. What it gives is not what computing the prompt would:
a run's K/V were computed after the old prompt's earlier tokens, not the new one's. So only requests that
ask for it reuse, and their blocks from the first reused one on are filed in the prefix cache under a chain
of their own (BlockManager), never found by an exact prefix lookup nor written to the disk tier. A run
copied unshifted from blocks that were themselves computed exactly (the rest of a common prefix, in a
partial block) is exact, and leaves the request exact.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass, field

GRAM = 8  # tokens a run's start is looked up by


@dataclass(slots=True)
class ReuseSource:
    """A recent request's tokens whose K/V sit in registered blocks (their hashes in order)."""

    tokens: list[int]
    hashes: list[int]  # of its first len(tokens) // block_size blocks
    approx_from: int | None  # its first block whose contents are not what computing its tokens gives
    _starts: dict[tuple[int, ...], list[int]] | None = field(default=None, repr=False)

    def starts(self, gram: tuple[int, ...]) -> list[int]:
        """The positions where these GRAM tokens start, ascending."""
        if self._starts is None:
            where: dict[tuple[int, ...], list[int]] = defaultdict(list)
            t = self.tokens
            for i in range(len(t) - GRAM + 1):
                where[tuple(t[i : i + GRAM])].append(i)
            self._starts = dict(where)
        return self._starts.get(gram, [])


@dataclass(slots=True, frozen=True)
class Run:
    src: int  # first position in the source
    dst: int  # first position in the request
    length: int

    @property
    def shift(self) -> int:
        return self.dst - self.src


@dataclass(slots=True)
class ReusePlan:
    source: ReuseSource
    runs: list[Run]

    @property
    def end(self) -> int:
        """The end of the last run: the request holds or computes every position before it once admitted."""
        return self.runs[-1].dst + self.runs[-1].length

    def first_inexact(self, block_size: int) -> int | None:
        """The request's first position whose copied row is not what computing it gives (shifted, or from a
        source block that was not computed exactly); None: every row is exact."""
        bound = None if self.source.approx_from is None else self.source.approx_from * block_size
        for r in self.runs:
            if r.shift != 0:
                return r.dst
            if bound is not None and r.src + r.length > bound:
                return r.dst + max(0, bound - r.src)
        return None


def plan_runs(
    source: ReuseSource, usable: int, tokens: list[int], start: int, limit: int, min_run: int, settle: int = 0
) -> list[Run]:
    """Runs of the source's first `usable` tokens (those whose blocks are still cached) to copy into a request
    of `tokens` whose first `start` positions it holds already, below `limit` (the request computes at least
    its last token). First the rest of the common prefix (any length); then, walking the request's tokens, the
    first place at or after the last run's end in the source where a run of at least `min_run` of them starts
    (llama-server's rule), extended as far as the two agree. Where no run starts, the token is the request's
    to compute (typed text, a word tokenized anew at a seam) and the walk goes on from the next one: the runs
    may leave gaps, which the request computes in order before the run after each (Request.held). Each run
    but the common prefix's starts `settle` tokens in: the tokens right after a change are computed, not moved
    (what they attend to changed the most, and what comes after attends to them)."""
    old = source.tokens[:usable]
    common = 0
    bound = min(len(old), limit)
    while common < bound and old[common] == tokens[common]:
        common += 1
    runs = []
    if common > start:
        runs.append(Run(start, start, common - start))
        head_p = head_c = common
    else:
        head_p, head_c = start, common
    min_run = max(min_run, GRAM)
    while head_p + min_run <= limit and head_c + min_run <= len(old):
        places = source.starts(tuple(tokens[head_p : head_p + GRAM]))
        want = tokens[head_p : head_p + min_run]
        found = None
        for c in places[bisect_left(places, head_c) :]:
            if c + min_run > len(old):
                break
            if old[c : c + min_run] == want:
                found = c
                break
        if found is None:
            head_p += 1  # computed by the request
            continue
        n = min_run
        while found + n < len(old) and head_p + n < limit and old[found + n] == tokens[head_p + n]:
            n += 1
        if n > settle:
            runs.append(Run(found + settle, head_p + settle, n - settle))
        head_p, head_c = head_p + n, found + n
    return runs

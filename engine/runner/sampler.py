"""Batched next-token sampling: logit bias, penalties and DRY, then one fused pass per row (a grammar's mask,
temperature, top-k, top-p, min-p and the draw) in ops.sample_tokens, or, for a row that asks for top-nσ,
typical-p, XTC or Mirostat, the chain of engine/runner/chain.py."""

from __future__ import annotations

import secrets
from collections.abc import Callable

import numpy as np
import torch

from minibatch.engine.core.request import Request
from minibatch.engine.models.ops import LogitEdits, TorchOps
from minibatch.engine.runner.chain import pack
from minibatch.engine.runner.dry import breaker_mask, dry_penalties

_KEY_BITS = (1 << 63) - 1  # keys and counters travel as int64


class SeenTokens:
    """The tokens a request has seen, for its penalties: the prompt's distinct ids once, and the output's
    counts kept as tokens are taken (and given back when a verify walk rolls its draft tokens off), so a
    step costs what changed, not the whole history."""

    __slots__ = ("prompt", "prompt_set", "counts", "counted", "extra")

    def __init__(self, prompt: list[int]) -> None:
        self.prompt = np.unique(np.asarray(prompt, dtype=np.int64))
        self.prompt_set = set(prompt)
        self.counts: dict[int, int] = {}  # output token -> times taken
        self.counted: list[int] = []  # the output tokens counted, in order
        self.extra: dict[int, None] = {}  # output tokens the prompt lacks (an ordered set)

    def sync(self, output: list[int]) -> None:
        """Count `output` as the request holds it now (it only grows, or loses its last tokens)."""
        keep = min(len(self.counted), len(output))
        if keep and self.counted[keep - 1] != output[keep - 1]:
            keep = 0  # not the same history: count it afresh
        while len(self.counted) > keep:
            token = self.counted.pop()
            left = self.counts[token] - 1
            if left:
                self.counts[token] = left
            else:
                del self.counts[token]
                self.extra.pop(token, None)
        for token in output[len(self.counted) :]:
            self.counted.append(token)
            if token in self.counts:
                self.counts[token] += 1
            else:
                self.counts[token] = 1
                if token not in self.prompt_set:
                    self.extra[token] = None

    def seen_ids(self) -> np.ndarray:
        """Every distinct token of the prompt and the output."""
        if not self.extra:
            return self.prompt
        return np.concatenate([self.prompt, np.fromiter(self.extra, dtype=np.int64, count=len(self.extra))])

    def output_counts(self) -> tuple[np.ndarray, np.ndarray]:
        n = len(self.counts)
        return np.fromiter(self.counts, dtype=np.int64, count=n), np.fromiter(self.counts.values(), np.float64, n)


class Sampler:
    """Picks one token per row of logits.

    Logit bias, penalties and DRY change the rows first: gathered per row as LogitEdits (the tokens they
    touch, phase by phase) and applied by `ops.edit_logits` (index operations on the CPU, one Triton launch
    per phase on a GPU); then `ops.sample_tokens` takes each row's token in one pass: the grammar's mask, temperature,
    top-k, top-p, min-p and the draw (kernels/cpu/csrc/sampling.cpp states the rule, TorchOps.sample_tokens is
    its twin). Rows that are all greedy with no grammar take the argmax directly.

    Draws are counter-based (engine/runner/philox.py): a row's uniform is Philox's at (key, position), the
    key being the request's seed or, unseeded, this sampler's random key mixed with the request id, the
    position that of the token drawn. A seeded request gets the same tokens alone, in any batch, with or
    without speculation, and after a restart.
    """

    def __init__(
        self,
        ops: TorchOps | None = None,
        key: int | None = None,
        token_texts: Callable[[int], list[str]] | None = None,
    ) -> None:
        self.ops = ops or TorchOps()  # the model's (CpuOps: kernels on the CPU's pool)
        self.key = secrets.randbits(63) if key is None else key & _KEY_BITS  # the unseeded requests' stream
        self.seen: dict[str, SeenTokens] = {}
        self.mu: dict[str, float] = {}  # each Mirostat request's state
        # each token's text (the tokenizer's), for DRY's sequence breakers; None: no token is a breaker
        self.token_texts = token_texts
        self._texts: list[str] | None = None
        self._breakers: dict[tuple[str, ...], np.ndarray] = {}  # breaker strings -> bool [vocab]

    def forget(self, request_id: str) -> None:
        self.seen.pop(request_id, None)
        self.mu.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, reqs: list[Request], positions: list[int] | None = None) -> list[int]:
        """logits [rows, vocab], changed in place by bias and penalties; `positions`: each row's token index in
        its output (default: the next one, len(output_token_ids))."""
        logits = logits.float()
        edits = Edits()
        biased = [i for i, r in enumerate(reqs) if r.params.logit_bias]
        if biased:
            logit_bias_edits(edits, biased, [reqs[i] for i in biased])
        penalised = [i for i, r in enumerate(reqs) if r.params.needs_penalties]
        if penalised:
            self._penalise(edits, penalised, [reqs[i] for i in penalised])
        dry = [i for i, r in enumerate(reqs) if r.params.needs_dry]
        if dry:
            self._dry(edits, logits.shape[1], dry, [reqs[i] for i in dry])
        if edits.phases:
            self.ops.edit_logits(logits, edits.pack())
        guided = [i for i, r in enumerate(reqs) if r.params.grammar is not None]
        if not guided and all(r.params.greedy for r in reqs):
            return self.ops.argmax_rows(logits).tolist()
        if positions is None:
            positions = [len(r.output_token_ids) for r in reqs]
        chained = [i for i, r in enumerate(reqs) if r.params.needs_chain]
        if not chained:
            return self._fused(logits, reqs, positions)
        tokens = [0] * len(reqs)
        fused = [i for i in range(len(reqs)) if not reqs[i].params.needs_chain]
        if fused:
            rows = torch.tensor(fused, device=logits.device)
            picked = self._fused(logits[rows], [reqs[i] for i in fused], [positions[i] for i in fused])
            for i, t in zip(fused, picked):
                tokens[i] = t
        sub = [reqs[i] for i in chained]
        streams = torch.tensor([(self._key(r), positions[i]) for i, r in zip(chained, sub)], dtype=torch.int64)
        rows = torch.tensor(chained, device=logits.device)
        settings = pack([r.params for r in sub], [self.mu.get(r.request_id) for r in sub])
        out = self.ops.sample_chain(logits[rows].cpu(), settings, streams, self._masks(logits, sub)).tolist()
        for i, r, (t, mu) in zip(chained, sub, out):
            tokens[i] = int(t)
            if mu == mu:  # not NaN: a Mirostat row's new mu
                self.mu[r.request_id] = mu
        return tokens

    def _masks(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor | None:
        """The grammars' allowed tokens, one bit each (every bit set for a row without a grammar), or None."""
        if all(r.params.grammar is None for r in reqs):
            return None
        # The grammar's mask goes last: whatever came before, a token it forbids is never picked.
        words = np.full((len(reqs), (logits.shape[1] + 31) // 32), -1, dtype=np.int32)
        for i, r in enumerate(reqs):
            if r.params.grammar is not None:
                words[i] = 0
                r.params.grammar.fill_mask(words[i])
        return torch.from_numpy(words)

    def _fused(self, logits: torch.Tensor, reqs: list[Request], positions: list[int]) -> list[int]:
        settings = torch.tensor(
            [(0.0 if p.greedy else p.temperature, p.top_p, p.min_p, float(p.top_k)) for p in (r.params for r in reqs)],
            dtype=torch.float64,
        )
        streams = torch.tensor([(self._key(r), n) for r, n in zip(reqs, positions)], dtype=torch.int64)
        return self.ops.sample_tokens(logits, settings, streams, self._masks(logits, reqs)).tolist()

    def _key(self, r: Request) -> int:
        seed = r.params.seed
        return seed if seed is not None else (self.key ^ hash(r.request_id)) & _KEY_BITS

    def _dry(self, edits: Edits, vocab: int, rows: list[int], reqs: list[Request]) -> None:
        """Each row's DRY penalties (engine/runner/dry.py), subtracted after everything else."""
        for row, r in zip(rows, reqs):
            context = np.asarray(r.prompt_token_ids + r.output_token_ids, dtype=np.int64)
            tokens, penalty = dry_penalties(
                context, self._breaker_mask(r.params.dry_sequence_breakers, vocab), r.params
            )
            edits.add(DRY, row, tokens, -penalty)

    def _breaker_mask(self, breakers: list[str], vocab: int) -> np.ndarray | None:
        if self.token_texts is None or not breakers:
            return None
        key = tuple(breakers)
        mask = self._breakers.get(key)
        if mask is None:
            if self._texts is None:
                self._texts = self.token_texts(vocab)
            if len(self._breakers) >= 64:  # distinct breaker lists kept at most
                self._breakers.clear()
            mask = self._breakers[key] = breaker_mask(self._texts, breakers)
        return mask

    def _penalise(self, edits: Edits, rows: list[int], reqs: list[Request]) -> None:
        """Repetition penalty over every token seen, then presence and frequency over the output's counts,
        from each request's SeenTokens."""
        for row, r in zip(rows, reqs):
            seen = self.seen.get(r.request_id)
            if seen is None:
                seen = self.seen[r.request_id] = SeenTokens(r.prompt_token_ids)
            seen.sync(r.output_token_ids)
            p = r.params
            if p.repetition_penalty != 1.0:
                ids = seen.seen_ids()
                edits.add(REPETITION, row, ids, np.full(len(ids), p.repetition_penalty))
            if seen.counts and (p.presence_penalty or p.frequency_penalty):
                ids, counts = seen.output_counts()
                edits.add(PENALTIES, row, ids, -(p.frequency_penalty * counts + p.presence_penalty))


BIAS, REPETITION, PENALTIES, DRY = range(4)  # LogitEdits' phases


class Edits:
    """LogitEdits gathered row by row, phase by phase."""

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = [[], [], [], []]

    @property
    def phases(self) -> bool:
        return any(self.parts)

    def add(self, phase: int, row: int, tokens: np.ndarray, values: np.ndarray) -> None:
        if len(tokens):
            self.parts[phase].append((np.full(len(tokens), row, dtype=np.int64), tokens, values))

    def pack(self) -> LogitEdits:
        rows, tokens, values, counts = [], [], [], []
        for part in self.parts:
            counts.append(sum(len(t) for _, t, _ in part))
            for r, t, v in part:
                rows.append(r)
                tokens.append(np.asarray(t, dtype=np.int64))
                values.append(np.asarray(v, dtype=np.float32))
        return LogitEdits(
            torch.from_numpy(np.concatenate(rows)),
            torch.from_numpy(np.concatenate(tokens)),
            torch.from_numpy(np.concatenate(values)),
            (counts[0], counts[1], counts[2], counts[3]),
        )


def logit_bias_edits(edits: Edits, rows: list[int], reqs: list[Request]) -> None:
    """Each request's logit_bias on its own row (grammar masks come after: a ban stays a ban)."""
    for row, r in zip(rows, reqs):
        bias = r.params.logit_bias
        tokens = np.fromiter(bias.keys(), np.int64, len(bias))
        edits.add(BIAS, row, tokens, np.fromiter(bias.values(), np.float64, len(bias)))

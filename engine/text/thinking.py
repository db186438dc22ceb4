"""A thinking model's answer constrained after its thoughts, and its thoughts bounded.

`ThinkingGate` is a grammar state (core/sampling_params.GrammarState) that wraps the answer's own grammar --
a response format's or a forced tool call's, or none. Until the model has closed its thinking (`</think>`, one
token of the vocabulary by tokenizer.reasoning_tags' rule) every token is free, so a JSON schema constrains
the answer and not the thoughts; once `budget` thinking tokens are spent the only token allowed is the close,
after which the answer's grammar takes over. With an answer grammar the thinking cannot end the output (the
end-of-sequence tokens are masked out until it is closed), so there is always an answer to parse.

Phases: `before` (the output may open the thinking or start the answer straight away), `thinking`, `answer`.
Every accepted token is remembered so a speculative walk can be rolled back exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from minibatch.engine.core.sampling_params import GrammarState

BEFORE, THINKING, ANSWER = 0, 1, 2


def _set(words: np.ndarray, token: int, on: bool) -> None:
    view = words.view("uint32")
    bit = 1 << (token & 31)
    if on:
        view[token >> 5] |= bit
    else:
        view[token >> 5] &= ~bit & 0xFFFFFFFF


class ThinkingGate:
    """The answer's grammar (`inner`, or None: any answer) after the thinking; at most `budget` thinking tokens."""

    __slots__ = ("inner", "open_id", "close_id", "eos_ids", "budget", "phase", "spent", "_history")

    def __init__(
        self,
        inner: GrammarState | None,
        open_id: int,
        close_id: int,
        eos_ids: list[int],
        inside: bool,
        budget: int | None = None,
    ) -> None:
        if budget is not None and budget < 0:
            raise ValueError(f"budget: must be >= 0, got {budget}")
        self.inner, self.open_id, self.close_id = inner, open_id, close_id
        self.eos_ids, self.budget = list(eos_ids), budget
        self.phase = THINKING if inside else BEFORE
        self.spent = 0  # thinking tokens taken (the tags not counted)
        # per accepted token: (phase before it, spent before it, whether the inner grammar took it)
        self._history: list[tuple[int, int, bool]] = []

    @property
    def answering(self) -> bool:
        return self.phase == ANSWER

    def _must_close(self, phase: int, spent: int) -> bool:
        return phase == THINKING and self.budget is not None and spent >= self.budget

    def fill_mask(self, words: np.ndarray) -> None:
        if self.phase == ANSWER and self.inner is not None:
            self.inner.fill_mask(words)
            return
        if self._must_close(self.phase, self.spent):
            words[:] = 0
            _set(words, self.close_id, True)
            return
        if self.phase == BEFORE and self.inner is not None:
            self.inner.fill_mask(words)  # the answer straight away, or the thinking opened
            _set(words, self.open_id, True)
            return
        words[:] = -1  # every token
        if self.phase == THINKING and self.inner is not None:
            for eos in self.eos_ids:  # an answer must follow the thoughts
                _set(words, eos, False)

    def _step(self, phase: int, spent: int, token: int) -> tuple[int, int, bool | None]:
        """(phase, spent) after `token` and whether the inner grammar must take it (None: not allowed)."""
        if phase == BEFORE:
            if token == self.open_id:
                return THINKING, spent, False
            return ANSWER, spent, True
        if phase == THINKING:
            if token == self.close_id:
                return ANSWER, spent, False
            if self._must_close(phase, spent) or (self.inner is not None and token in self.eos_ids):
                return phase, spent, None
            return THINKING, spent + 1, False
        return ANSWER, spent, True

    def accept(self, token_id: int) -> bool:
        phase, spent, inner = self._step(self.phase, self.spent, token_id)
        if inner is None:
            return False
        if inner and self.inner is not None and not self.inner.accept(token_id):
            return False
        self._history.append((self.phase, self.spent, bool(inner and self.inner is not None)))
        self.phase, self.spent = phase, spent
        return True

    def is_done(self) -> bool:
        return self.phase == ANSWER and self.inner is not None and self.inner.is_done()

    def validate(self, tokens: list[int]) -> int:
        phase, spent = self.phase, self.spent
        for i, token in enumerate(tokens):
            if phase == ANSWER:
                rest = tokens[i:]
                return i + (self.inner.validate(rest) if self.inner is not None else len(rest))
            phase, spent, inner = self._step(phase, spent, token)
            if inner is None:
                return i
            if inner and self.inner is not None:  # the first answer token: the inner grammar decides
                return i + self.inner.validate(tokens[i:])
        return len(tokens)

    def rollback(self, n: int) -> None:
        inner = 0
        for _ in range(n):
            self.phase, self.spent, took = self._history.pop()
            inner += took
        if inner and self.inner is not None:
            self.inner.rollback(inner)

"""The thinking gate on its own: free thoughts, the budget's forced close, the answer's grammar after it, and
exact rollback over a speculative walk. The inner grammar is a small fake (the daemon tests drive the real
llguidance one through a thinking model)."""

from __future__ import annotations

import numpy as np
import pytest

from minibatch.engine.text.thinking import ThinkingGate

VOCAB, OPEN, CLOSE, EOS = 64, 40, 41, 2


class Sequence:
    """Allows exactly `tokens`, in order, then is done."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.pos = tokens, 0

    def fill_mask(self, words: np.ndarray) -> None:
        words[:] = 0
        if self.pos < len(self.tokens):
            t = self.tokens[self.pos]
            words.view("uint32")[t >> 5] |= 1 << (t & 31)

    def accept(self, token_id: int) -> bool:
        if self.pos < len(self.tokens) and self.tokens[self.pos] == token_id:
            self.pos += 1
            return True
        return False

    def is_done(self) -> bool:
        return self.pos == len(self.tokens)

    def validate(self, tokens: list[int]) -> int:
        n = 0
        while n < len(tokens) and self.pos + n < len(self.tokens) and tokens[n] == self.tokens[self.pos + n]:
            n += 1
        return n

    def rollback(self, n: int) -> None:
        self.pos -= n


def allowed(gate: ThinkingGate) -> set[int]:
    words = np.zeros((VOCAB + 31) // 32, dtype=np.int32)
    gate.fill_mask(words)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:VOCAB]
    return {int(i) for i in np.flatnonzero(bits)}


def test_thoughts_are_free_then_the_answer_follows_its_grammar():
    gate = ThinkingGate(Sequence([7, 8]), OPEN, CLOSE, [EOS], inside=True)
    assert allowed(gate) == set(range(VOCAB)) - {EOS}  # anything but the end: an answer must follow
    for t in (3, 4, 5):
        assert gate.accept(t) and not gate.is_done()
    assert not gate.accept(EOS)  # refused, and nothing changed
    assert gate.accept(CLOSE) and gate.answering and gate.spent == 3
    assert allowed(gate) == {7}
    assert gate.accept(7) and allowed(gate) == {8} and gate.accept(8) and gate.is_done()


def test_the_budget_closes_the_thinking():
    gate = ThinkingGate(Sequence([7]), OPEN, CLOSE, [EOS], inside=True, budget=2)
    assert gate.accept(3) and gate.accept(4)
    assert allowed(gate) == {CLOSE} and not gate.accept(5)
    assert gate.accept(CLOSE) and allowed(gate) == {7}
    zero = ThinkingGate(None, OPEN, CLOSE, [EOS], inside=True, budget=0)
    assert allowed(zero) == {CLOSE}  # no thinking at all
    assert zero.accept(CLOSE) and allowed(zero) == set(range(VOCAB)) and not zero.is_done()
    with pytest.raises(ValueError, match="budget"):
        ThinkingGate(None, OPEN, CLOSE, [EOS], inside=True, budget=-1)


def test_before_the_thinking_the_output_may_open_it_or_answer():
    gate = ThinkingGate(Sequence([7]), OPEN, CLOSE, [EOS], inside=False)
    assert allowed(gate) == {7, OPEN}
    assert gate.accept(7) and gate.answering and gate.is_done()
    opened = ThinkingGate(Sequence([7]), OPEN, CLOSE, [EOS], inside=False, budget=1)
    assert opened.accept(OPEN) and opened.spent == 0 and opened.accept(9) and allowed(opened) == {CLOSE}
    free = ThinkingGate(None, OPEN, CLOSE, [EOS], inside=False, budget=4)  # a budget alone: every token
    assert allowed(free) == set(range(VOCAB))


def test_validate_and_rollback_over_a_speculative_walk():
    gate = ThinkingGate(Sequence([7, 8]), OPEN, CLOSE, [EOS], inside=True, budget=3)
    assert gate.validate([3, 4, CLOSE, 7, 9]) == 4  # the inner grammar refuses 9
    assert gate.validate([3, 4, 5, 6]) == 3  # the budget allows three thoughts
    assert gate.validate([3, EOS]) == 1
    assert gate.phase == 1 and gate.spent == 0  # unchanged
    for t in (3, CLOSE, 7):
        assert gate.accept(t)
    gate.rollback(2)  # back before the close: the inner grammar is rolled back too
    assert gate.spent == 1 and not gate.answering and gate.inner.pos == 0
    assert gate.accept(CLOSE) and gate.accept(7) and gate.accept(8) and gate.is_done()

"""The transcript's streaming split: which part of a growing answer is finished Markdown."""

from __future__ import annotations

from minibatch.tui.widgets.transcript import stable_prefix


def test_the_finished_part_ends_at_the_last_blank_line():
    text = "First paragraph.\n\nSecond one, still"
    assert text[: stable_prefix(text)] == "First paragraph.\n\n"
    assert stable_prefix("no blank line yet") == 0
    assert stable_prefix("one\n\n") == 0  # a blank line at the very end may still become part of a list or fence


def test_a_blank_line_inside_a_code_fence_does_not_end_a_block():
    text = "Intro.\n\n```python\ndef f():\n\n    return 1\n"
    assert text[: stable_prefix(text)] == "Intro.\n\n"
    closed = text + "```\n\nAfter"
    assert closed[: stable_prefix(closed)] == text + "```\n\n"
    tilde = "~~~\na\n\nb\n"
    assert stable_prefix(tilde) == 0

"""The transcript's streaming split: which part of a growing answer is finished Markdown."""

from __future__ import annotations

import asyncio

import pytest
from textual.app import App

from minibatch.tui.widgets.stream_cuts import continuation_cut, stable_prefix, wrapped_cut
from minibatch.tui.widgets.transcript import Transcript


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


def test_a_tight_list_is_cut_before_its_newest_item():
    text = "Intro.\n\n- a\n- b\n  more of b\n- c"
    start = stable_prefix(text)
    cut = continuation_cut(text, start)
    assert text[start : cut.at] == "- a\n- b\n  more of b\n" and cut.fence == ""
    assert continuation_cut(text, cut.at) is None  # one item left: nothing before it to keep
    assert continuation_cut("Para\nline two\nline three", 0) is None  # not a list: the paragraph is one block
    numbered = "1. one\n2. two\n10. ten\n"
    assert numbered[continuation_cut(numbered, 0).at :] == "10. ten\n"


def test_an_open_code_fence_is_cut_before_its_newest_line_and_carries_its_opener():
    text = "Here:\n```python\nx = 1\ny = 2\nz"
    cut = continuation_cut(text, 0)
    assert text[: cut.at] == "Here:\n```python\nx = 1\ny = 2\n" and cut.fence == "```python\n"
    more = text + " = 3\nw = 4\n"
    again = continuation_cut(more, cut.at, cut.fence)
    assert more[cut.at : again.at] == "z = 3\n" and again.fence == "```python\n"
    assert continuation_cut(more + "```\n", again.at, again.fence) is None  # closed: the rest is one block
    assert continuation_cut("```python\nx = 1\n", 0) is None  # one line of code: nothing to keep yet


def test_a_paragraph_is_cut_after_its_wrapped_lines_only_where_the_rest_cannot_restyle_them():
    text = "Intro.\n\nthe cat sailed far away and came back home"
    start = stable_prefix(text)
    at = wrapped_cut(text, start, "the cat sailed far ")  # the first wrapped line, as drawn
    assert text[at:] == "away and came back home"
    assert wrapped_cut(text, start, "the cat sail") is None  # the line ends inside a word (folded)
    assert wrapped_cut(text, start, "the dog") is None  # not the text as written (an entity, say)
    assert wrapped_cut("a *b c d", 0, "a *b ") is None  # a mark: a later * would make 'b c' emphasis
    assert wrapped_cut("sail on 1. then more", 0, "sail on ") is None  # alone, '1. then' is a list
    assert wrapped_cut("sail on", 0, "sail on") is None  # nothing after it yet


LIST = "Steps:\n\n" + "".join(
    f"{i}. **Step {i}**: do the thing number {i}, carefully and twice.\n" for i in range(1, 31)
)
CODE = "Code:\n\n```python\n" + "".join(f"value_{i} = compute({i}, scale=2)\n" for i in range(30)) + "```\n\nDone."

WORDS = "the cat learned to sail across the bay & back again! in 1. the morning - she said 42 knots, then 7"
LONG_WORD = "supercalifragilistic" * 5  # wider than the view: rich folds it across lines
PARAGRAPHS = (
    " ".join([WORDS] * 8 + [LONG_WORD] + [WORDS] * 6)
    + "\n\nThen **bold**, `code` and &amp; in a short one.\n\n"
    + " ".join([WORDS] * 2)
    + "\nafter a line break "
    + WORDS
    + "\n\n"
    + " ".join([WORDS] * 2)
    + "\n---\n\nDone."
)


def by_lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def by_chunks(text: str, size: int = 20) -> list[str]:  # a few tokens a frame
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize(
    "answer, pieces, bound",
    [(LIST, by_lines, 4), (CODE, by_lines, 4), (PARAGRAPHS, by_chunks, 8)],
    ids=["tight list", "code block", "long paragraphs"],
)
def test_a_streaming_answer_is_drawn_as_its_whole_markdown_and_rendered_once_a_part(answer, pieces, bound):
    """Streamed a line (or a few tokens) at a time, the answer shows at each step what its whole Markdown
    shows, and the text rendered over the stream grows with the answer, not with its square. The
    paragraphs: a long one cut after its wrapped lines (list-like words and a folded long word in it,
    a number at a line's start), one with marks and an entity (not cut), one with a line break (drawn
    whole again), one that a setext underline turns into a heading."""

    async def go():
        app = Host()
        async with app.run_test(size=(70, 30)):
            t, ref = app.query_one("#t", Transcript), app.query_one("#ref", Transcript)
            rendered = []
            lines = t._markdown_lines
            t._markdown_lines = lambda text, *a: rendered.append(len(text)) or lines(text, *a)
            i = t.add("assistant", "", streaming=True)
            r = ref.add("assistant", "")
            mismatches, text = [], ""
            for line in pieces(answer):
                t.append(i, line)
                text += line
                ref.set_text(r, text)
                if t.plain_lines() != ref.plain_lines():
                    mismatches.append(text)
            return mismatches, sum(rendered)

    mismatches, rendered = asyncio.run(go())
    assert mismatches == []
    # re-rendering the whole tail each step: 15-18x here, 32x the paragraphs (cut: 7x)
    assert rendered < bound * len(answer)


class Host(App):
    def compose(self):
        yield Transcript(id="t")
        yield Transcript(id="ref")

"""Where a streaming Markdown answer may be cut, so that each part of it is rendered once.

Rendering an answer's unfinished tail again at every frame costs time in proportion to the tail: an answer
that is one tight list or one long code block (no blank line until it ends) would be rendered whole at every
frame, which grows with the square of its length (a 20-item list ~4 ms a render here, a 40-line code block
far more). So besides the finished blocks (`stable_prefix`: up to the last blank line outside a code fence)
a tail is cut where its block goes on (`continuation_cut`): before the newest item of a tight list, or
before the newest line of a code fence that is still open. The part before such a cut is rendered once and
kept; the transcript joins the parts without the seams (the blank line rich puts before a list, a code
block's padding rows). A long paragraph is cut after its wrapped lines but the last (`wrapped_cut`): those
are final while it grows at its end, as long as no later text can restyle them. The whole answer is
rendered once more when it ends.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LIST_ITEM = re.compile(r"(?:[-*+]|\d{1,9}[.)])(?: |\t)")  # a list item's marker at the start of a line
ORDERED_ITEM = re.compile(r"(\d{1,9})[.)](?: |\t)")
FENCES = ("```", "~~~")
# What lets later text restyle a paragraph's earlier text: emphasis, code spans, strikethrough, links,
# inline HTML, table cells, escapes. (A line break too, which wrapped_cut's caller refuses: a setext
# underline on the next line makes the whole paragraph a heading.)
INLINE_MARKS = frozenset("*_`~[]<|\\")


def stable_prefix(text: str) -> int:
    """Length of the part of a streaming Markdown text whose blocks are finished: up to its last blank
    line that is outside a fenced code block (0 if none)."""
    end, fenced, pos = 0, False, 0
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith(FENCES):
            fenced = not fenced
        pos += len(line)
        if not stripped and not fenced and pos < len(text):
            end = pos
    return end


@dataclass(slots=True, frozen=True)
class Cut:
    at: int  # the text before this offset is rendered now and kept
    fence: str  # the opening line of the code fence the cut falls in ("" outside one): the rest follows it


def continuation_cut(text: str, start: int, fence: str = "") -> Cut | None:
    """A cut after `start` (a cut made before, or the stable prefix) inside a block that goes on: before the
    newest top-level item of the tight list that text[start:] is, or before the newest line of a code
    fence open at the end (`fence`: the opening line when text[start:] begins inside one). None: nowhere."""
    lines = text[start:].splitlines(keepends=True)
    offsets, pos = [], start
    for line in lines:
        offsets.append(pos)
        pos += len(line)
    opener, opened_at = fence, -1 if fence else None  # the open fence's line, and its index here
    for i, line in enumerate(lines):
        if line.strip().startswith(FENCES):
            opener, opened_at = ("", None) if opener else (line if line.endswith("\n") else "", i)
    if opener and opened_at is not None:
        last = len(lines) - 1  # before the newest line, with a line of code at least before it in the part
        return Cut(offsets[last], opener) if last > opened_at + 1 else None
    if fence or not lines or not LIST_ITEM.match(lines[0]) or opened_at is not None:
        return None
    items = [i for i in range(1, len(lines)) if LIST_ITEM.match(lines[i])]
    return Cut(offsets[items[-1]], "") if items else None


def last_number(text: str, start: int) -> int:
    """The number rich pads the numbers of the ordered list that text[start:] begins with to (its first
    number plus its item count; 0: no such list). A part of the list drawn before it has every item is
    padded to this number too, and drawn anew when its width grows (past 9 or 99 items)."""
    lines = text[start:].splitlines()
    first = ORDERED_ITEM.match(lines[0]) if lines else None
    if first is None:
        return 0
    return int(first.group(1)) + sum(1 for line in lines if ORDERED_ITEM.match(line))


def wrapped_cut(text: str, start: int, lines: str) -> int | None:
    """Where to cut a one-line paragraph that text[start:] renders, after its first wrapped lines (`lines`:
    their text): the offset of the next line's first word. Wrapping is greedy, so those lines stay as they
    are while the paragraph grows at its end, and the rest, rendered alone, wraps as it does within the
    whole. None where that does not hold: the lines are not the text's words as written (an entity drawn
    as its character), they end inside a word (a long word folded), their text has one of INLINE_MARKS,
    or the rest does not begin with a letter (alone, '1. ' or '- ' would begin a list)."""
    words = "".join(lines.split())
    pos, seen = start, 0
    while pos < len(text) and seen < len(words):
        if not text[pos].isspace():
            if text[pos] != words[seen]:
                return None
            seen += 1
        pos += 1
    if seen < len(words) or pos >= len(text) or not text[pos].isspace() or INLINE_MARKS.intersection(text[start:pos]):
        return None
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos if pos < len(text) and text[pos].isalpha() else None

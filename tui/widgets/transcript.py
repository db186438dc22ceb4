"""A conversation's messages as one scrolling widget that draws only its visible lines.

A transcript made of Markdown widgets (one widget per block of every message) costs a layout of the
whole screen and a repaint of every block that moved each time an answer grows: with four panes
streaming that was most of the chat's CPU. Here each message is rendered once to lines (rich's
Markdown for answers) and kept; a streaming answer re-renders only its tail — the text after its last
finished block (a blank line outside a code fence) — while the finished blocks' lines stay cached.
When the answer ends it is rendered once whole, so the final picture is the message's own Markdown.
Growing changes only this widget's virtual height, and it repaints only its own visible lines.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from markdown_it import MarkdownIt
from rich.markdown import Markdown as RichMarkdown
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.geometry import Region, Size
from textual.scroll_view import ScrollView
from textual.strip import Strip


class _Markdown(RichMarkdown):
    """rich's Markdown, parsed by one shared parser: rich builds a new parser for every text it is given,
    which cost more than the parse itself at every frame of a streaming answer."""

    _parser = MarkdownIt().enable("strikethrough").enable("table")
    _defaults = dict(vars(RichMarkdown("")))

    def __init__(self, markup: str) -> None:
        self.__dict__.update(self._defaults)
        self.markup = markup
        self.parsed = self._parser.parse(markup)


def stable_prefix(text: str) -> int:
    """Length of the part of a streaming Markdown text whose blocks are finished: up to its last blank
    line that is outside a fenced code block (0 if none)."""
    end, fenced, pos = 0, False, 0
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            fenced = not fenced
        pos += len(line)
        if not stripped and not fenced and pos < len(text):
            end = pos
    return end


@dataclass(slots=True)
class Message:
    role: str  # "user" | "assistant"
    text: str
    streaming: bool = False
    stable: int = 0  # streaming: text[:stable] is rendered in head
    head: list[Strip] = field(default_factory=list)  # the finished blocks' lines (streaming)
    lines: list[Strip] = field(default_factory=list)  # all of its lines at the current width


class Transcript(ScrollView, can_focus=False):
    """Messages added whole (`add`) or streamed (`add(..., streaming=True)`, `append`, `finish`)."""

    def __init__(self, messages: list[dict] | None = None, accent: str = "#61afef", **kw) -> None:
        super().__init__(**kw)
        self.accent = accent
        self.messages = [Message(m["role"], m["content"]) for m in messages or []]
        self._width = 0
        self._total = 0  # lines over all messages
        self._line_style = Style()

    # -- the conversation -------------------------------------------------
    def add(self, role: str, text: str, streaming: bool = False) -> int:
        self.messages.append(Message(role, text, streaming))
        self._render(self.messages[-1])
        self._changed(len(self.messages) - 1)
        return len(self.messages) - 1

    def append(self, index: int, text: str) -> None:
        """More streamed text for message `index`: only the unfinished tail is rendered again."""
        m = self.messages[index]
        m.text += text
        self._render(m)
        self._changed(index, len(m.head))

    def set_text(self, index: int, text: str) -> None:
        m = self.messages[index]
        m.text, m.stable, m.head = text, 0, []
        self._render(m)
        self._changed(index)

    def finish(self, index: int) -> None:
        """The stream ended: render the whole message once as the Markdown it is."""
        m = self.messages[index]
        m.streaming, m.stable, m.head = False, 0, []
        self._render(m)
        self._changed(index)

    def clear(self) -> None:
        self.messages.clear()
        self._changed()

    def texts(self) -> list[str]:
        return [m.text for m in self.messages]

    def plain_lines(self) -> list[str]:
        """What the transcript shows, as text (all of it, not only the visible part)."""
        return [strip.text.rstrip() for m in self.messages for strip in m.lines]

    # -- rendering --------------------------------------------------------
    def _content_width(self) -> int:
        return max(8, self.scrollable_content_region.width or self.size.width or 40)

    def _render(self, m: Message) -> None:
        width = self._width or self._content_width()
        if m.role == "user":
            m.lines = self._user_lines(m.text, width)
        elif not m.streaming:
            m.lines = self._markdown_lines(m.text, width)
        else:
            stable = stable_prefix(m.text)
            if stable != m.stable:  # a block finished: render the finished part once more, then keep it
                m.stable, m.head = stable, self._markdown_lines(m.text[:stable], width) if stable else []
            m.lines = m.head + self._markdown_lines(m.text[m.stable :], width)
        m.lines.append(Strip.blank(0))  # a blank line between messages

    def _markdown_lines(self, text: str, width: int) -> list[Strip]:
        if not text.strip():
            return []
        console = self.app.console
        options = console.options.update(width=width, height=None)
        return [Strip(line) for line in console.render_lines(_Markdown(text), options, pad=False)]

    def _user_lines(self, text: str, width: int) -> list[Strip]:
        console = self.app.console
        options = console.options.update(width=max(1, width - 2), height=None)
        bar = Segment("▌ ", Style(color=self.accent))
        lines = console.render_lines(Text(text, style="dim"), options, pad=False)
        return [Strip([bar, *line]) for line in lines]

    def _changed(self, index: int | None = None, kept: int = 0) -> None:
        """Lines of message `index` from its `kept`-th on (all messages' when None) were rendered anew."""
        at_end = self.is_vertical_scroll_end or self.max_scroll_y == 0
        total = sum(len(m.lines) for m in self.messages)
        if total != self._total or self.virtual_size.width != self._width or index is None:
            self._total = total  # a new height: the view moves, so all of it is drawn again
            self.virtual_size = Size(self._width, total)
            if at_end:
                self.scroll_end(animate=False, immediate=True, x_axis=False)
            self.refresh()
            return
        first = sum(len(m.lines) for m in self.messages[:index]) + kept  # the same height: repaint the changed rows
        self.refresh(Region(0, first - self.scroll_offset.y, self.size.width, total - first))

    def render_lines(self, crop: Region) -> list[Strip]:
        self._line_style = self.rich_style  # once a paint, not once a line: it walks the styles each time
        return super().render_lines(crop)

    def on_resize(self) -> None:
        width = self._content_width()
        if width != self._width:
            self._width = width
            for m in self.messages:
                m.stable, m.head = 0, []
                self._render(m)
            self._changed()

    def render_line(self, y: int) -> Strip:
        _, scroll_y = self.scroll_offset
        index = scroll_y + y
        width = self.scrollable_content_region.width
        style = self._line_style
        for m in self.messages:
            if index < len(m.lines):
                return m.lines[index].crop_extend(0, width, style)
            index -= len(m.lines)
        return Strip.blank(width, style)

"""A conversation's messages as one scrolling widget that draws only its visible lines.

A transcript made of Markdown widgets (one widget per block of every message) costs a layout of the
whole screen and a repaint of every block that moved each time an answer grows: with four panes
streaming that was most of the chat's CPU. Here each message is rendered once to lines (rich's
Markdown for answers) and kept; a streaming answer re-renders only its tail — the text after its last
finished block (a blank line outside a code fence) — while the finished blocks' lines stay cached.
When the answer ends it is rendered once whole, so the final picture is the message's own Markdown.
Growing changes only this widget's virtual height (no layout of the screen), a view that follows the
answer scrolls ahead by a third of its height at a time, and between scrolls only the changed rows are
painted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from markdown_it import MarkdownIt
from rich.markdown import ListElement
from rich.markdown import Markdown as RichMarkdown
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.geometry import Region, Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from .stream_cuts import continuation_cut, last_number, stable_prefix, wrapped_cut

JUMP = 3  # a view that follows the end scrolls ahead by 1/JUMP of its height at a time (see _changed)


class _List(ListElement):
    """rich's list, whose numbers are as wide as those of the list it is a part of (`_Markdown.numbers_to`)."""

    @classmethod
    def create(cls, markdown: _Markdown, token) -> _List:
        element = cls(token.type, int(token.attrs.get("start", 1)))
        element.numbers_to = markdown.numbers_to
        return element

    def __rich_console__(self, console, options):
        if self.list_type == "bullet_list_open":
            yield from super().__rich_console__(console, options)
            return
        first = 1 if self.list_start is None else self.list_start
        last = max(first + len(self.items), self.numbers_to)  # rich pads every number to this one's width
        for i, item in enumerate(self.items):
            yield from item.render_number(console, options, first + i, last)


class _Markdown(RichMarkdown):
    """rich's Markdown, parsed by one shared parser: rich builds a new parser for every text it is given,
    which cost more than the parse itself at every frame of a streaming answer. `numbers_to`: an ordered
    list's numbers are as wide as this one's (a part of a longer list is drawn as within it)."""

    _parser = MarkdownIt().enable("strikethrough").enable("table")
    _defaults = dict(vars(RichMarkdown("")))
    elements = {**RichMarkdown.elements, "ordered_list_open": _List}

    def __init__(self, markup: str, numbers_to: int = 0) -> None:
        self.__dict__.update(self._defaults)
        self.markup = markup
        self.numbers_to = numbers_to
        self.parsed = self._parser.parse(markup)


def _seamless(lines: list[Strip], continues: bool, goes_on: bool) -> list[Strip]:
    """A part of a block cut in two (stream_cuts.py): without the blank row rich starts it with when it
    `continues` one drawn above (a list's spacing, a code block's top padding), nor the padding it ends
    with when it `goes_on` in the next part."""
    if continues and lines and not lines[0].text.strip():
        lines = lines[1:]
    if goes_on and lines and not lines[-1].text.strip():
        lines = lines[:-1]
    return lines


@dataclass(slots=True)
class Message:
    role: str  # "user" | "assistant"
    text: str
    streaming: bool = False
    stable: int = 0  # streaming: text[:stable] is rendered in head
    head: list[Strip] = field(default_factory=list)  # the finished blocks' lines (streaming)
    cut: int = 0  # streaming: text[stable:cut] is rendered in parts, a block that goes on (stream_cuts.py)
    fence: str = ""  # the code fence open at `cut`: the tail is rendered after its opening line
    parts: list[Strip] = field(default_factory=list)
    numbers: int = 0  # the number rich pads the parts' ordered list to (stream_cuts.last_number)
    paragraph: bool = False  # the parts are a one-line paragraph's final wrapped lines (stream_cuts.wrapped_cut)
    lines: list[Strip] = field(default_factory=list)  # all of its lines at the current width
    images: tuple[str, ...] = ()  # a user message's attached images (paths), drawn as thumbnails above it

    def restart(self) -> None:
        """Render it whole at the next render."""
        self.stable, self.head = 0, []
        self.restart_parts()

    def restart_parts(self) -> None:
        self.cut, self.fence, self.parts, self.numbers, self.paragraph = self.stable, "", [], 0, False


class Transcript(ScrollView, can_focus=False):
    """Messages added whole (`add`) or streamed (`add(..., streaming=True)`, `append`, `finish`).

    Its scrollbar is always shown: one that appeared when an answer first overflowed the view narrowed
    the text, so every message was rendered again at the new width, in a layout of the whole screen."""

    DEFAULT_CSS = """
    Transcript {
        overflow-y: scroll;
    }
    """

    def __init__(self, messages: list[dict] | None = None, accent: str = "#61afef", **kw) -> None:
        super().__init__(**kw)
        self.accent = accent
        self.messages = [Message(m["role"], m["content"], images=tuple(m.get("images") or ())) for m in messages or []]
        self._width = 0
        self._line_style = Style()

    # -- the conversation -------------------------------------------------
    def add(self, role: str, text: str, streaming: bool = False, images: tuple[str, ...] = ()) -> int:
        self.messages.append(Message(role, text, streaming, images=images))
        self._render(self.messages[-1])
        self._changed(len(self.messages) - 1)
        return len(self.messages) - 1

    def append(self, index: int, text: str) -> None:
        """More streamed text for message `index`: only the unfinished tail is rendered again."""
        m = self.messages[index]
        kept = len(m.head) + len(m.parts)  # the lines drawn before that stay (a block finishing adds to them)
        m.text += text
        self._render(m)
        self._changed(index, min(kept, len(m.head) + len(m.parts)))

    def set_text(self, index: int, text: str) -> None:
        m = self.messages[index]
        m.text = text
        m.restart()
        self._render(m)
        self._changed(index)

    def finish(self, index: int) -> None:
        """The stream ended: render the whole message once as the Markdown it is."""
        m = self.messages[index]
        m.streaming = False
        m.restart()
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
            m.lines = self._image_lines(m.images, width) + self._user_lines(m.text, width)
        elif not m.streaming:
            m.lines = self._markdown_lines(m.text, width)
        else:
            stable = stable_prefix(m.text)
            if stable != m.stable:  # a block finished: render the finished part once more, then keep it
                m.stable, m.head = stable, self._markdown_lines(m.text[:stable], width) if stable else []
                m.restart_parts()
            if m.paragraph and m.text.find("\n", m.stable) != -1:  # a line break: it may render otherwise, all again
                m.restart_parts()
            numbers = last_number(m.text, m.stable)
            if len(str(numbers)) != len(str(m.numbers)):  # the list's numbers got wider: its parts are drawn anew
                m.restart_parts()
            m.numbers = numbers
            cut = continuation_cut(m.text, m.cut, m.fence)
            if cut is not None:  # a block goes on: what came before the cut is rendered once, and kept
                m.parts += self._part_lines(m, m.text[m.cut : cut.at], width, bool(cut.fence))
                m.cut, m.fence = cut.at, cut.fence
            tail = self._part_lines(m, m.text[m.cut :], width, False)
            if sum(bool(s.text.strip()) for s in tail) > 1 and self._paragraph_goes_on(m):
                at = wrapped_cut(m.text, m.cut, "".join(s.text for s in tail[:-1]))
                if at is not None:  # its wrapped lines but the last are final: kept, and the rest drawn alone
                    m.parts += tail[:-1]
                    m.cut, m.paragraph = at, True
                    tail = self._part_lines(m, m.text[m.cut :], width, False)
            m.lines = m.head + m.parts + tail
        m.lines.append(Strip.blank(0))  # a blank line between messages

    def _paragraph_goes_on(self, m: Message) -> bool:
        """Whether the streaming message's unfinished block is one line of paragraph so far, with no other
        cut in it (a list's or a code fence's)."""
        if m.fence or m.text.find("\n", m.stable) != -1:  # (find: no copy of the tail at every frame)
            return False
        if m.paragraph or m.cut != m.stable:  # a paragraph's cut before (its kind holds), or a list's
            return m.paragraph
        tokens = _Markdown._parser.parse(m.text[m.stable :])
        return [t.type for t in tokens] == ["paragraph_open", "inline", "paragraph_close"]

    def _part_lines(self, m: Message, text: str, width: int, goes_on: bool) -> list[Strip]:
        """The lines of the streaming message `m`'s text[m.cut:] up to `text`'s end, as they stand in the
        whole message's rendering: after the finished blocks, with the blank line rich puts between two
        blocks (a one-line block rendered before it, then dropped, gives it its place); after a part of
        the same block, without the seams (stream_cuts.py)."""
        n = m.numbers
        if m.cut > m.stable:
            return _seamless(self._markdown_lines(m.fence + text, width, n), True, goes_on)
        if m.stable:
            return _seamless(self._markdown_lines("x\n\n" + text, width, n)[1:], False, goes_on)
        return _seamless(self._markdown_lines(text, width, n), False, goes_on)

    def _markdown_lines(self, text: str, width: int, numbers_to: int = 0) -> list[Strip]:
        if not text.strip():
            return []
        console = self.app.console
        options = console.options.update(width=width, height=None)
        return [Strip(line) for line in console.render_lines(_Markdown(text, numbers_to), options, pad=False)]

    def _user_lines(self, text: str, width: int) -> list[Strip]:
        console = self.app.console
        options = console.options.update(width=max(1, width - 2), height=None)
        bar = Segment("▌ ", Style(color=self.accent))
        lines = console.render_lines(Text(text, style="dim"), options, pad=False)
        return [Strip([bar, *line]) for line in lines]

    def _image_lines(self, images: tuple[str, ...], width: int) -> list[Strip]:
        """Each attached image as a thumbnail of half-block cells, its file's name under it."""
        from pathlib import Path

        from ..attachments import THUMB_WIDTH, thumbnail

        console, out = self.app.console, []
        options = console.options.update(width=max(1, width - 2), height=None)
        bar = Segment("▌ ", Style(color=self.accent))
        for image in map(Path, images):
            picture = console.render_lines(thumbnail(image, min(THUMB_WIDTH, width - 2)), options, pad=False)
            caption = console.render_lines(Text(f"🖼 {image.name}", style="dim italic"), options, pad=False)
            out += [Strip([bar, *line]) for line in [*picture, *caption]]
        return out

    def _changed(self, index: int | None = None, kept: int = 0) -> None:
        """Lines of message `index` from its `kept`-th on (all messages' when None) were rendered anew.

        A view that follows the end scrolls by a third of its height when the text reaches its bottom
        (xterm's jump scroll), not by a line each time a line is added: a scroll moves every row, so the
        whole view is painted again, while text landing in the blank rows below the last line repaints
        only those rows. With six panes streaming that is one full repaint every few frames instead of
        six each frame, and the text stays still while it is read."""
        at_end = self.is_vertical_scroll_end or self.max_scroll_y == 0
        total = sum(len(m.lines) for m in self.messages)
        virtual = self.virtual_size.height
        if index is None or self.virtual_size.width != self._width or total > virtual:
            height = self.scrollable_content_region.height
            ahead = height // JUMP if index is not None and at_end and total > height else 0
            laid_out = self._grow(Size(self._width, total + ahead))  # a new height: all of the view is drawn
            if at_end:  # after the layout when there is one: the view's new size is not known before it
                self.scroll_end(animate=False, immediate=not laid_out, x_axis=False)
            self.refresh()
            return
        first = sum(len(m.lines) for m in self.messages[:index]) + kept  # the height holds: repaint from there
        top = first - self.scroll_offset.y
        self.refresh(Region(0, max(0, top), self.size.width, max(0, self.size.height - max(0, top))))

    def _grow(self, size: Size) -> bool:
        """A new virtual size. Setting it the usual way lays out the whole screen (the reactive is declared
        with layout=True): with six panes streaming that was some twenty layouts a second, each one every
        widget's arrangement and the scrollbars' resize. The scrollbar is always there (DEFAULT_CSS), so
        the content width holds while the text grows and only a new width needs a layout; otherwise the
        size is set without one and the scrollbar is told its new proportions, which repaints only the
        scrollbar. True: a layout comes."""
        _, height = self.container_size
        if not height or size.width != self.virtual_size.width:
            self.virtual_size = size
            return True
        self.set_reactive(ScrollView.virtual_size, size)
        bar = self.vertical_scrollbar
        bar.window_virtual_size, bar.window_size = size.height, height - self.scrollbar_size_horizontal
        bar.refresh()
        return False

    def render_lines(self, crop: Region) -> list[Strip]:
        self._line_style = self.rich_style  # once a paint, not once a line: it walks the styles each time
        return super().render_lines(crop)

    def on_resize(self) -> None:
        width = self._content_width()
        if width != self._width:
            self._width = width
            for m in self.messages:
                m.restart()
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

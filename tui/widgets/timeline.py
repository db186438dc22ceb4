"""The batch over time: one line per batch row, one column per engine step, newest on the right.

Each cell is coloured by the pane whose request held that row (grey: another
client) and marked by what the row did: ▒ a prefill chunk, ▣ a prefill chunk that takes an image's
embeddings, █ a decode, 2-9 a
decode that verified a draft and took that many tokens in the step (+ for ten
or more), ▲ an embedding's prompt chunk (it leaves the batch with its prompt: no
decode follows), ╳ padding (static mode computing a finished request's row: wasted),
┄ held without computing, · empty; a row under a LoRA adapter decodes as that adapter's letter (a, b, c
by name, as the block map marks its blocks; named in a legend line). Beneath, the waiting queue per step. In static
mode finished rows turn to ╳ until the longest member ends (a staircase);
in continuous mode a freed row takes the next request at the next step.
"""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual.widgets import Static

KEEP = 512  # step records kept client-side (the daemon keeps its own ring)
MARKS = {
    "p": "▒",
    "i": "▣",
    "d": "█",
    "e": "▲",
    "x": "╳",
    "h": "┄",
}  # "v" (verified) shows the tokens taken: verified_mark


def adapter_letters(names) -> dict[str, str]:
    """Each LoRA adapter shown (a row's adapters, "+"-joined) -> its letter, in the order of their names: the
    timeline and the block map give one adapter one letter."""
    return {name: chr(ord("a") + i % 26) for i, name in enumerate(sorted(set(names)))}


def verified_mark(accepted: int) -> str:
    """A verifying row took its accepted draft tokens and one of its own."""
    taken = accepted + 1
    return str(taken) if taken < 10 else "+"


def waiting_mark(n: int) -> str:
    return " " if n == 0 else str(n) if n < 10 else "+"


class Timeline(Static):
    """Fed step records (the dicts of GET /v1/engine/steps) by the app; draws the last `width` steps."""

    def __init__(self, colors: list[str], **kw) -> None:
        super().__init__("", **kw)
        self.pane_colors = colors
        self.records: deque[dict] = deque(maxlen=KEEP)
        self.last_step = 0
        self.max_rows = 0
        self._drawn: tuple | None = None  # (last step, size, panes) the picture shows

    def clear(self) -> None:
        """Another model's steps come next (the focused pane's model changed): start over."""
        self.records.clear()
        self.last_step, self._drawn = 0, None

    def add(self, payload: dict, panes: dict[str, int]) -> None:
        """New records from the daemon; `panes` maps request ids to pane indexes."""
        steps = payload.get("steps", [])
        if steps and steps[0]["step"] <= self.last_step:  # the daemon restarted: its steps count from 1 again
            self.records.clear()
        self.records.extend(steps)
        if steps:
            self.last_step = steps[-1]["step"]
        self.max_rows = payload.get("max_rows", self.max_rows)
        self.render_records(panes)

    def render_records(self, panes: dict[str, int]) -> None:
        width, height = self.size.width or 34, self.size.height or 20
        drawn = (self.last_step, width, height, len(panes))
        if drawn == self._drawn:  # no new step and no new size: the same picture
            return
        self._drawn = drawn
        self.update(
            render_timeline(list(self.records), panes, self.pane_colors, max(8, width - 5), height, self.max_rows)
        )


def render_timeline(
    records: list[dict], panes: dict[str, int], colors: list[str], cols: int, height: int, max_rows: int = 0
) -> Text:
    """The last `cols` steps of `records` as rows of marks, with a mode line above and the waiting queue below."""
    recent = records[-cols:]
    compact = height < 9  # a short panel (the narrow layout): no legend and no mode line, rows first
    text = Text("batch timeline ", style="bold")
    text.append("(ctrl+g: block map)\n", style="dim")
    if not compact:
        text.append("▒ prefill █ decode ╳ pad ┄ held\n", style="dim")
        if any(row[3] == "v" for r in recent for row in r["rows"]):
            text.append("2-9 tokens a row took (speculation)\n", style="dim")
        if any(row[3] == "i" for r in recent for row in r["rows"]):
            text.append("▣ prefill of an image's positions\n", style="dim")
    if not recent:
        text.append("no steps yet", style="dim")
        return text
    letters = adapter_letters(name for r in recent for name in r.get("adapters", {}).values())
    used = max((row for r in recent for row, *_ in r["rows"]), default=-1) + 1
    legend = 1 if letters and not compact else 0
    shown = max(1, min(used, max_rows or used, height - (2 if compact else 5 + legend)))
    if not compact:
        text.append("mode ", style="dim")
        prev = None
        for r in recent:  # a mode letter per step; a switch shows where the shape changes
            letter = "s" if r["mode"] == "static" else "c"
            text.append(letter, style="bold yellow" if prev is not None and letter != prev else "grey42")
            prev = letter
        text.append("\n")
    if letters and not compact:
        text.append("LoRA " + "  ".join(f"{c} {name}" for name, c in letters.items()) + "\n", style="dim")
    grid = [{} for _ in recent]
    for i, r in enumerate(recent):
        under = r.get("adapters", {})
        for row, rid, _n, state, *spec in r["rows"]:
            if row < shown:
                grid[i][row] = (rid, state, spec[1] if len(spec) > 1 else 0, letters.get(under.get(rid, "")))
    for row in range(shown):
        text.append(f"{row:>3}  ", style="dim")
        for cells in grid:
            cell = cells.get(row)
            if cell is None:
                text.append("·", style="grey23")
                continue
            rid, state, accepted, letter = cell
            pane = panes.get(rid)
            color = colors[pane % len(colors)] if pane is not None else "grey62"
            if state == "v":
                text.append(verified_mark(accepted), style=f"bold reverse {color}")
            elif state == "d" and letter is not None:
                text.append(letter, style=f"bold {color}")
            else:
                text.append(MARKS.get(state, "?"), style="red" if state == "x" else color)
        text.append("\n")
    if used > shown:
        text.append(f"     +{used - shown} more rows\n", style="dim")
    text.append("wait ", style="dim")
    for r in recent:
        text.append(waiting_mark(r["waiting"]), style="yellow")
    return text

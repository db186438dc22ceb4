"""The key reference."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS = [
    ("enter", "send the message in the focused pane"),
    ("escape", "stop the focused pane's answer (aborts it on the daemon)"),
    ("ctrl+b", "broadcast: send to every pane (its own pending input, or the focused pane's text)"),
    ("ctrl+n / ctrl+w", "open / close a pane (1 to 6)"),
    ("tab / shift+tab", "next / previous pane"),
    ("alt+arrows", "move between panes"),
    ("ctrl+t", "toggle static ⇄ continuous batching (shown once the daemon confirms)"),
    ("ctrl+g", "the batch timeline in place of the KV block map (and back): rows by step, coloured by pane"),
    ("ctrl+s", "settings of the focused pane (model, system prompt, temperature, top_p, max tokens, seed)"),
    ("ctrl+o", "the focused pane's model: any the daemon lists, loaded ones marked (it loads on first message)"),
    (
        "ctrl+f",
        "attach an image to the focused pane's next message (or drop a file, or paste its path, into the input)",
    ),
    ("ctrl+l", "clear the focused pane"),
    ("? / f1", "this help"),
    ("ctrl+q", "quit"),
]


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark,f1", "dismiss", "close")]

    def compose(self) -> ComposeResult:
        lines = "\n".join(f"[b]{k:>16}[/]  {v}" for k, v in KEYS)
        with Vertical(id="help"):
            yield Static("[b]minibatch-chat[/] — several conversations at once, and the batch that serves them\n")
            yield Static(lines)
            yield Static(
                "\n[dim]The engine panel shows the batch live: each running request occupies a row of the batch and "
                "holds KV blocks (the map colours them by pane). In static mode a batch admits nobody until it ends.[/]"
            )

"""Per-pane settings in a modal."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label

from ..history import PaneSettings

FIELDS = [
    ("model", "model (empty: the daemon's own; ctrl+o lists them)", str),
    ("system_prompt", "system prompt", str),
    ("temperature", "temperature (0 = greedy, up to 2)", float),
    ("top_p", "top_p (0, 1]", float),
    ("max_tokens", "max tokens (empty: the daemon's default)", int),
    ("seed", "seed (empty: none)", int),
]
LIMITS = {"temperature": (0.0, 2.0), "top_p": (1e-9, 1.0), "max_tokens": (1, 8192), "seed": (0, 2**63 - 1)}


def parse_settings(values: dict[str, str]) -> PaneSettings:
    """Raise ValueError naming the field when a value is not valid."""
    out = {}
    for name, label, typ in FIELDS:
        raw = values[name].strip()
        if name == "system_prompt":
            out[name] = values[name]
            continue
        if name == "model":
            out[name] = raw or None
            continue
        if name in ("seed", "max_tokens") and raw == "":
            out[name] = None
            continue
        try:
            value = typ(raw)
        except ValueError:
            raise ValueError(f"{label}: not a valid {typ.__name__}: {raw!r}") from None
        lo, hi = LIMITS[name]
        if not lo <= value <= hi:
            raise ValueError(f"{label}: must be between {lo:g} and {hi:g}")
        out[name] = value
    return PaneSettings(**out)


class SettingsScreen(ModalScreen[PaneSettings | None]):
    BINDINGS = [Binding("escape", "cancel", "cancel")]

    def __init__(self, settings: PaneSettings, title: str) -> None:
        super().__init__()
        self.settings, self.title_text = settings, title

    def compose(self) -> ComposeResult:
        with Vertical(id="settings"):
            yield Label(f"[b]{self.title_text}[/]")
            for name, label, _ in FIELDS:
                value = getattr(self.settings, name)
                yield Label(label)
                yield Input("" if value is None else str(value), id=f"set-{name}")
            yield Label("", id="settings-error")
            with Horizontal():
                yield Button("save", variant="primary", id="save")
                yield Button("cancel", id="cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "cancel":
            self.dismiss(None)
            return
        self.action_save()

    def on_input_submitted(self) -> None:
        self.action_save()

    def action_save(self) -> None:
        try:
            settings = parse_settings({name: self.query_one(f"#set-{name}", Input).value for name, _, _ in FIELDS})
        except ValueError as exc:
            self.query_one("#settings-error", Label).update(f"[red]{exc}[/]")
            return
        self.dismiss(settings)

    def action_cancel(self) -> None:
        self.dismiss(None)

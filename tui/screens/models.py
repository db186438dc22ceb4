"""The model picker: what the daemon can serve (GET /v1/models), the loaded ones marked, for one pane."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

DEFAULT = ""  # the option that means the daemon's own model


def model_options(models: list[dict], current: str | None) -> list[Option]:
    """One option per model, loaded ones first with a mark, the pane's own marked too."""
    options = [Option(f"{'● ' if current is None else '  '}the daemon's own model", id=DEFAULT)]
    for m in models:
        mark = "●" if m["id"] == current else " "
        state = "[green]loaded[/]" if m.get("loaded") else "[dim]loads on first use[/]"
        options.append(Option(f"{mark} {m['id']}  {state}", id=m["id"]))
    return options


class ModelScreen(ModalScreen[str | None]):
    """Dismissed with the model picked ("" for the daemon's own), or None when cancelled."""

    BINDINGS = [Binding("escape", "cancel", "cancel")]

    def __init__(self, models: list[dict], current: str | None, title: str) -> None:
        super().__init__()
        self.models, self.current, self.title_text = models, current, title

    def compose(self) -> ComposeResult:
        with Vertical(id="models"):
            yield Label(f"[b]{self.title_text}[/]  [dim]enter: pick · esc: cancel[/]")
            yield OptionList(*model_options(self.models, self.current), id="model-list")

    def on_mount(self) -> None:
        self.query_one(OptionList).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)

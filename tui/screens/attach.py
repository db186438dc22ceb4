"""A modal asking for an image file to attach to a pane's next message, with a preview of it: the terminal's
graphics protocol where it has one (kitty's, sixel), half-block cells elsewhere (textual-image picks)."""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label

from ..attachments import image_problem, split_attachment


class AttachScreen(ModalScreen[Path | None]):
    BINDINGS = [Binding("escape", "cancel", "cancel")]

    def __init__(self, title: str) -> None:
        super().__init__()
        self.title_text = title

    def compose(self) -> ComposeResult:
        with Vertical(id="attach"):
            yield Label(f"[b]{self.title_text}[/]")
            yield Label("an image file (png, jpg, webp, gif, bmp): type or paste its path, or drop the file here")
            yield Input(placeholder="~/Pictures/photo.png", id="attach-path")
            yield Label("", id="attach-error")

    def on_input_changed(self, event: Input.Changed) -> None:
        path, _ = split_attachment(event.value)
        preview = self.query("#attach-preview")
        if path is None:
            preview.remove()
            return
        from textual_image.widget import Image

        if preview:
            preview.first(Image).image = path
        else:
            self.query_one("#attach", Vertical).mount(Image(path, id="attach-preview"))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        path, _ = split_attachment(event.value)
        if path is None:
            path = Path(event.value.strip()).expanduser()
        problem = image_problem(path)
        if problem is not None:
            self.query_one("#attach-error", Label).update(f"[red]{problem}[/]")
            return
        self.dismiss(path)

    def action_cancel(self) -> None:
        self.dismiss(None)

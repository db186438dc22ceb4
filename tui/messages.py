"""Messages the TUI's widgets post to the app."""

from __future__ import annotations

from textual.message import Message


class PaneSubmitted(Message):
    """A pane's input was submitted."""

    def __init__(self, pane_id: int, text: str) -> None:
        super().__init__()
        self.pane_id, self.text = pane_id, text


class TurnFinished(Message):
    """A pane finished (or ended) a turn: persist it."""

    def __init__(self, pane_id: int, user: str, assistant: str, complete: bool, images: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.pane_id, self.user, self.assistant, self.complete = pane_id, user, assistant, complete
        self.images = images  # the user message's attached images (paths)


class RequestOwner(Message):
    """A pane's request id is known (to colour its KV blocks)."""

    def __init__(self, pane_id: int, request_id: str | None) -> None:
        super().__init__()
        self.pane_id, self.request_id = pane_id, request_id

"""One conversation: a streaming Markdown transcript, an input box, and the last answer's numbers."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from textual import work
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Input, Static

from ..attachments import api_messages, image_problem, split_attachment
from ..client import DaemonUnavailable
from ..history import PaneSettings
from ..messages import PaneSubmitted, RequestOwner, TurnFinished
from ..names import short_model_name
from .transcript import Transcript

PANE_COLORS = ["#e06c75", "#61afef", "#98c379", "#e5c07b", "#c678dd", "#56b6c2"]
# What a pane's status line says while the daemon is away; only these give way to "ready" when it is back
# (a finished answer's numbers stay).
RECONNECTING = "[yellow]reconnecting…[/]"
LOST = "[yellow]connection lost — reconnecting…[/]"


def format_status(timings: dict, tokens: int, seconds: float, finish: str | None, replica: str | None = None) -> str:
    ttft = timings.get("ttft_ms")
    parts = [f"TTFT {ttft:.0f} ms" if ttft is not None else "TTFT -"]
    decode = (timings.get("decode_ms") or 0) / 1000
    rate = (tokens - 1) / decode if tokens > 1 and decode > 0 else (tokens / seconds if seconds > 0 else 0)
    parts += [f"{rate:.1f} tok/s", f"{tokens} tok", finish or "-"]
    if timings.get("queue_wait_ms") is not None:
        parts.append(f"queue {timings['queue_wait_ms']:.0f} ms")
    parts.append(f"cached {timings.get('cached_prompt_tokens', 0)}")
    if timings.get("draft_tokens"):  # speculative decoding: draft tokens accepted of those verified
        parts.append(f"spec {timings.get('accepted_tokens', 0)}/{timings['draft_tokens']}")
    if replica:  # behind minibatch-serve, first: a narrow pane cuts the line's end
        parts.insert(0, f"replica {replica}")
    return " · ".join(parts)


class ChatPane(Vertical):
    """A chat pane. The app owns the client and history; the pane streams into its transcript."""

    DEFAULT_CLASSES = "pane"

    def __init__(
        self, pane_id: int, index: int, settings: PaneSettings | None = None, messages: list[dict] | None = None
    ) -> None:
        super().__init__(id=f"pane-{pane_id}")
        self.pane_id, self.index = pane_id, index
        self.settings = settings or PaneSettings()
        self.messages: list[dict] = list(messages or [])
        self.busy = False
        self.color = PANE_COLORS[index % len(PANE_COLORS)]
        # Streamed text waits here until the app's next frame draws it (flush): tokens arrive faster than
        # it is worth drawing them, and every frame is CPU the engine beside the chat does not get.
        self._pending: list[str] = []
        self._answer: int | None = None  # the streaming answer's index in the transcript
        self._chunks = 0
        self._status = "ready"
        self._before_lost = "ready"  # the status line a reconnect gives back
        self.flushes = 0  # transcript updates drawn, over the pane's life
        self.attached: list[Path] = []  # images that go with the next message
        self.input = Input(
            placeholder="Message (enter to send, esc to stop, ctrl+f or a dropped file: an image)", classes="pane-input"
        )

    def compose(self) -> ComposeResult:
        yield Static(self._title(), classes="pane-title")
        yield Transcript(self.messages, self.color, classes="transcript")
        yield Static(self._status, classes="pane-status")
        yield Static("", classes="pane-attached")
        yield self.input

    def on_mount(self) -> None:
        self.query_one(".pane-attached", Static).display = False

    # -- images for the next message -----------------------------------------
    def attach(self, path: Path) -> str | None:
        """Attach an image to the next message; why not, when it cannot be."""
        problem = image_problem(path)
        if problem is not None:
            return problem
        self.attached.append(path)
        self._show_attached()
        return None

    def detach(self) -> None:
        self.attached.clear()
        self._show_attached()

    def _show_attached(self) -> None:
        line = self.query_one(".pane-attached", Static)
        line.display = bool(self.attached)
        names = ", ".join(p.name for p in self.attached)
        line.update(f"[b]🖼 {names}[/] [dim]goes with the next message · ctrl+f another[/]")

    def _title(self) -> str:
        model = short_model_name(self.settings.model) if self.settings.model else "default model"
        return (
            f"[b {self.color}]■[/] pane {self.index + 1}  {model}  "
            f"[dim]t={self.settings.temperature:g} max={self.settings.max_tokens or 'default'} · ctrl+o model[/]"
        )

    def refresh_title(self) -> None:
        self.query_one(".pane-title", Static).update(self._title())

    def set_status(self, text: str) -> None:
        """The line under the transcript; one row high whatever it says, so it redraws without a layout."""
        if text != self._status:
            self._status = text
            self.query_one(".pane-status", Static).update(text, layout=False)

    def connection_lost(self) -> None:
        """The daemon is away: an idle pane says so, and says again what it said before once it is back."""
        if not self.busy and self._status not in (RECONNECTING, LOST):
            self._before_lost = self._status
            self.set_status(RECONNECTING)

    def connection_back(self) -> None:
        if not self.busy and self._status in (RECONNECTING, LOST):
            self.set_status(self._before_lost if self._status == RECONNECTING else "ready")

    @property
    def undrawn(self) -> bool:
        """Streamed text waits for the next frame."""
        return bool(self._pending)

    @property
    def chunks(self) -> int:
        """Pieces of the current (or last) answer streamed so far."""
        return self._chunks

    @property
    def transcript(self) -> Transcript:
        return self.query_one(Transcript)

    def flush(self, status: bool = True) -> None:
        """Draw what streamed in since the last frame: one transcript update (and the status line's count)."""
        if not self._pending or self._answer is None:
            return
        text = "".join(self._pending)
        self._pending.clear()
        self.flushes += 1
        if status:
            self.set_status(f"generating… {self._chunks} chunks")
        self.transcript.append(self._answer, text)

    def focus_input(self) -> None:
        self.input.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        text = self.take_attachments(event.value.strip())
        if event.value.strip() != text:  # image paths were taken from its start
            event.input.value = text
        if text and not self.busy:
            event.input.value = ""
            self.post_message(PaneSubmitted(self.pane_id, text))

    def take_attachments(self, text: str) -> str:
        """Attach the image files the input starts with (a path typed, pasted or dropped); the rest."""
        while True:
            path, rest = split_attachment(text)
            if path is None:
                return text
            problem = self.attach(path)
            if problem is not None:
                self.set_status(f"[red]{problem}[/]")
                return text
            text = rest

    def pending_input(self) -> str:
        return self.input.value.strip()

    def take_input(self) -> str:
        inp = self.input
        text, inp.value = inp.value.strip(), ""
        return text

    def clear(self) -> None:
        self.cancel()
        self.detach()
        self.messages.clear()
        self.transcript.clear()
        self.set_status("cleared")

    def cancel(self) -> bool:
        """Stop this pane's generation (the daemon aborts the request when the stream closes)."""
        if not self.busy:
            return False
        self.workers.cancel_group(self, "generate")
        return True

    def ask(self, client, text: str) -> None:
        if self.busy:
            return
        self.busy = True
        self.generate(client, text)

    @work(exclusive=True, group="generate")
    async def generate(self, client, text: str) -> None:
        transcript = self.transcript
        images = tuple(str(p) for p in self.attached)
        self.detach()
        transcript.add("user", text, images=images)
        answer = self._answer = transcript.add("assistant", "", streaming=True)
        convo = [{"role": "system", "content": self.settings.system_prompt}] if self.settings.system_prompt else []
        asked = {"role": "user", "content": text, **({"images": list(images)} if images else {})}
        convo = await asyncio.to_thread(api_messages, [*convo, *self.messages, asked])  # (the images' files read)
        self._chunks = 0
        parts: list[str] = []
        tokens, timings, finish, started, replica = 0, {}, None, time.monotonic(), None
        self.set_status("waiting for the engine…")
        complete = False
        try:
            async for delta in client.chat(convo, **self.settings.request_params()):
                if delta.error:
                    self.set_status(f"[red]error:[/] {delta.error}")
                    break
                if delta.request_id:
                    self.post_message(RequestOwner(self.pane_id, delta.request_id))
                replica = delta.replica or replica
                if delta.text:
                    parts.append(delta.text)
                    self._pending.append(delta.text)
                    tokens += 1
                    self._chunks = tokens
                if delta.usage:
                    tokens = delta.usage.get("completion_tokens", tokens)
                if delta.finish_reason:
                    finish, timings, complete = delta.finish_reason, delta.timings, True
            if complete:
                self.set_status(format_status(timings, tokens, time.monotonic() - started, finish, replica))
        except DaemonUnavailable:
            self.set_status(LOST)
        finally:
            self.flush(status=False)  # the tail that came after the last frame
            self._answer = None
            transcript.finish(answer)
            if not complete and not parts:
                transcript.set_text(answer, "_(stopped)_")
            elif not complete:
                self.set_status("[yellow]stopped[/] (esc)") if self.busy else None
            answer_text = "".join(parts)
            self.messages += [asked, {"role": "assistant", "content": answer_text}]
            self.post_message(TurnFinished(self.pane_id, text, answer_text, complete, images))
            self.post_message(RequestOwner(self.pane_id, None))
            self.busy = False

"""Snapshot of the whole app at a fixed size: two panes mid-answer and the engine panel populated."""

from __future__ import annotations


from textual.widgets import Input

from minibatch.tui.app import MinibatchChat
from minibatch.tui.history import History

from .fakes import FakeClient, event


def test_two_panes_mid_answer_with_engine_panel(snap_compare, tmp_path):
    client = FakeClient("Continuous batching lets **new requests join** between steps.", hold=True)
    history = History(tmp_path / "chat.sqlite3")
    app = MinibatchChat(client, history, poll_interval=0.05)

    async def run_before(pilot) -> None:
        for inp in app.query(Input):
            inp.cursor_blink = False
        await pilot.press("ctrl+n")
        await pilot.pause()
        for inp in app.query(Input):
            inp.cursor_blink = False
        for ch in "why":
            await pilot.press(ch)
        await pilot.press("ctrl+b")
        while client.events_queue is None or client.next_id < 2:
            await pilot.pause(0.02)
        client.events_queue.put_nowait(event(mode="continuous", running=2, waiting=1, used=12, step=42))
        await pilot.pause(0.3)
        for pane in app.panes():
            pane.set_status("generating…")  # the chunk counter depends on timing; pin it

    assert snap_compare(app, terminal_size=(120, 34), run_before=run_before)
    client.release.set()
    history.close()

"""Snapshots of the whole app at a fixed size: two panes mid-answer with the engine panel populated, and the batch
timeline in both modes."""

from __future__ import annotations

from textual.widgets import Input

from minibatch.tui.app import MinibatchChat
from minibatch.tui.history import History

from .fakes import FakeClient, event


async def drawn(pilot, app, step: int) -> None:
    """Until the panel shows the event of `step` and no pane has streamed text waiting for a frame."""
    while app.panel.drawn_step != step or any(p.undrawn for p in app.panes()):
        await pilot.pause(0.02)


async def two_panes_asking(pilot, app, client, text: str) -> None:
    """Open a second pane, broadcast `text`, wait until both requests are out; cursors still (for stable pictures)."""
    for inp in app.query(Input):
        inp.cursor_blink = False
    await pilot.press("ctrl+n")
    await pilot.pause()
    for inp in app.query(Input):
        inp.cursor_blink = False
    for ch in text:
        await pilot.press(ch)
    await pilot.press("ctrl+b")
    while client.events_queue is None or client.next_id < 2:
        await pilot.pause(0.02)


def test_two_panes_mid_answer_with_engine_panel(snap_compare, tmp_path):
    client = FakeClient("Continuous batching lets **new requests join** between steps.", hold=True)
    history = History(tmp_path / "chat.sqlite3")
    app = MinibatchChat(client, history, poll_interval=0.05)

    async def run_before(pilot) -> None:
        await two_panes_asking(pilot, app, client, "why")
        client.events_queue.put_nowait(event(mode="continuous", running=2, waiting=1, used=12, step=42))
        await drawn(pilot, app, 42)
        for pane in app.panes():
            pane.set_status("generating…")  # the chunk counter depends on timing; pin it

    assert snap_compare(app, terminal_size=(120, 34), run_before=run_before)
    client.release.set()
    history.close()


def timeline_records(static: bool) -> list:
    """Two panes' requests (req-0, req-1) and another client's (other-*), 30 steps, in one mode."""
    from .fakes import step_record

    recs = []
    for step in range(1, 31):
        rows = []
        if (
            static
        ):  # one batch of three: members finish at 8, 14, 30 and pad until the longest ends; then the next batch
            for row, (rid, end) in enumerate((("req-0", 8), ("req-1", 14), ("other-a", 30))):
                rows.append([row, rid, 6 if step == 1 else 1, "p" if step == 1 else ("x" if step > end else "d")])
            waiting = 2
        else:  # a finished row is taken by the next request at the next step
            for row, (rid, end) in enumerate((("req-0", 8), ("req-1", 14), ("other-a", 30))):
                if step <= end:
                    rows.append([row, rid, 6 if step == 1 else 1, "p" if step == 1 else "d"])
                else:
                    nxt = f"other-{row}"
                    rows.append([row, nxt, 6 if step == end + 1 else 1, "p" if step == end + 1 else "d"])
            waiting = 2 if step <= 8 else 1 if step <= 14 else 0
        recs.append(step_record(step, rows, "static" if static else "continuous", waiting))
    return recs


def _timeline_snapshot(snap_compare, tmp_path, static: bool):
    client = FakeClient("Rows refill as soon as they free up.", hold=True)
    client.step_records = timeline_records(static)
    history = History(tmp_path / "chat.sqlite3")
    app = MinibatchChat(client, history, poll_interval=0.05)

    async def run_before(pilot) -> None:
        await two_panes_asking(pilot, app, client, "go")
        client.events_queue.put_nowait(
            event(mode="static" if static else "continuous", running=3, waiting=2, used=12, step=30)
        )
        await pilot.press("ctrl+g")
        panel = app.query_one("EnginePanel")
        while panel.timeline.last_step < 30:
            await pilot.pause(0.02)
        await drawn(pilot, app, 30)
        for pane in app.panes():
            pane.set_status("generating…")

    assert snap_compare(app, terminal_size=(120, 34), run_before=run_before)
    client.release.set()
    history.close()


def test_timeline_in_continuous_mode(snap_compare, tmp_path):
    _timeline_snapshot(snap_compare, tmp_path, static=False)


def test_timeline_in_static_mode(snap_compare, tmp_path):
    _timeline_snapshot(snap_compare, tmp_path, static=True)

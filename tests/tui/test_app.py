"""minibatch-chat driven with Textual's pilot against a fake client (the real daemon is in test_tmux.py)."""

from __future__ import annotations

import asyncio

import pytest

from minibatch.tui.app import MinibatchChat
from minibatch.tui.client import Delta
from minibatch.tui.history import History, PaneSettings
from minibatch.tui.screens.settings import SettingsScreen, parse_settings
from minibatch.tui.widgets.chat_pane import ChatPane, format_status
from minibatch.tui.widgets.engine_panel import EnginePanel, block_map_cells

from .fakes import FakeClient, event, step_record


async def wait_until(pilot, cond, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await pilot.pause(0.02)


def transcript_texts(pane: ChatPane) -> list[str]:
    return pane.transcript.texts()


@pytest.fixture
def history(tmp_path):
    h = History(tmp_path / "chat.sqlite3")
    yield h
    h.close()


async def type_and_send(pilot, text):
    for ch in text:
        await pilot.press(ch if ch != " " else "space")
    await pilot.press("enter")


def test_send_streams_the_answer_and_saves_history(history):
    client = FakeClient("Paris is the capital.")

    async def go():
        app = MinibatchChat(client, history)
        async with app.run_test(size=(120, 36)) as pilot:
            await type_and_send(pilot, "capital of France?")
            pane = app.panes()[0]
            await wait_until(pilot, lambda: not pane.busy and len(pane.messages) == 2)
            texts = transcript_texts(pane)
            status = str(pane.query_one(".pane-status").render())
            return texts, status

    texts, status = asyncio.run(go())
    assert texts[0] == "capital of France?" and texts[1].strip() == "Paris is the capital."
    assert "TTFT 12 ms" in status and "stop" in status and "cached 16" in status
    assert client.chats[0][-1] == {"role": "user", "content": "capital of France?"}
    stored = history.panes()[0].messages
    assert stored == [
        {"role": "user", "content": "capital of France?"},
        {"role": "assistant", "content": "Paris is the capital. "},
    ]


def test_multi_turn_history_is_sent_each_turn_and_restored(history):
    client = FakeClient("ok")

    async def go():
        app = MinibatchChat(client, history)
        async with app.run_test(size=(120, 36)) as pilot:
            pane = app.panes()[0]
            await type_and_send(pilot, "one")
            await wait_until(pilot, lambda: len(pane.messages) == 2 and not pane.busy)
            await type_and_send(pilot, "two")
            await wait_until(pilot, lambda: len(pane.messages) == 4 and not pane.busy)

    asyncio.run(go())
    assert [m["content"] for m in client.chats[1]] == ["one", "ok ", "two"]

    async def reopen():
        app = MinibatchChat(FakeClient(), history)
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause()
            return transcript_texts(app.panes()[0])

    assert [t.strip() for t in asyncio.run(reopen())] == ["one", "ok", "two", "ok"]


def _png(path, size=(40, 20)):
    from PIL import Image

    Image.new("RGB", size, (200, 30, 30)).save(path)
    return path


def test_an_image_dropped_into_the_input_goes_with_the_message_and_stays_as_a_thumbnail(history, tmp_path):
    """A dropped file's path (quoted, with a space in it) at the start of the input attaches it; the rest is the
    message. The image goes as a data: URL part before the text, is drawn in the transcript in half-block
    cells with its name, is sent again with the next turn and comes back with the history."""
    cat = _png(tmp_path / "my cat.png")
    client = FakeClient("A red square.")

    async def go():
        app = MinibatchChat(client, history)
        async with app.run_test(size=(120, 36)) as pilot:
            pane = app.panes()[0]
            pane.input.value = f"'{cat}' what is it?"
            await pilot.press("enter")
            await wait_until(pilot, lambda: not pane.busy and len(pane.messages) == 2)
            shown = "\n".join(pane.transcript.plain_lines())
            attached_then = list(pane.attached)
            await type_and_send(pilot, "and now?")
            await wait_until(pilot, lambda: not pane.busy and len(pane.messages) == 4)
            return shown, attached_then

    shown, attached_then = asyncio.run(go())
    first = client.chats[0][-1]
    assert first["role"] == "user" and first["content"][-1] == {"type": "text", "text": "what is it?"}
    url = first["content"][0]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,") and len(url) > 100
    assert "my cat.png" in shown and "▀" in shown and "what is it?" in shown
    assert attached_then == []  # (sent: the next message has none of its own)
    assert client.chats[1][0] == first and client.chats[1][-1] == {"role": "user", "content": "and now?"}
    stored = history.panes()[0].messages
    assert stored[0] == {"role": "user", "content": "what is it?", "images": [str(cat)]}

    async def reopen():
        app = MinibatchChat(FakeClient(), history)
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause()
            return "\n".join(app.panes()[0].transcript.plain_lines())

    assert "my cat.png" in asyncio.run(reopen())


def test_ctrl_f_asks_for_an_image_and_refuses_what_is_not_one(history, tmp_path):
    from minibatch.tui.screens.attach import AttachScreen

    photo = _png(tmp_path / "photo.png")
    (tmp_path / "notes.txt").write_text("hi")
    client = FakeClient("ok")

    async def go():
        app = MinibatchChat(client, history)
        async with app.run_test(size=(120, 36)) as pilot:
            pane = app.panes()[0]
            await pilot.press("ctrl+f")
            await wait_until(pilot, lambda: isinstance(app.screen, AttachScreen))
            box = app.screen.query_one("#attach-path")
            box.value = str(tmp_path / "notes.txt")
            await pilot.press("enter")
            await pilot.pause()
            refused = str(app.screen.query_one("#attach-error").render())
            box.value = str(photo)
            await pilot.pause()
            previewed = bool(app.screen.query("#attach-preview"))
            await pilot.press("enter")
            await wait_until(pilot, lambda: not isinstance(app.screen, AttachScreen))
            line = str(pane.query_one(".pane-attached").render())
            return refused, previewed, list(pane.attached), line

    refused, previewed, attached, line = asyncio.run(go())
    assert "notes.txt: not an image file" in refused
    assert previewed and attached == [photo] and "photo.png" in line


def test_escape_cancels_the_generation(history):
    client = FakeClient("a long answer", hold=True)

    async def go():
        app = MinibatchChat(client, history)
        async with app.run_test(size=(120, 36)) as pilot:
            pane = app.panes()[0]
            await type_and_send(pilot, "talk")
            await wait_until(pilot, lambda: "long" in "".join(transcript_texts(pane)))
            await pilot.press("escape")
            await wait_until(pilot, lambda: not pane.busy)
            return str(pane.query_one(".pane-status").render())

    status = asyncio.run(go())
    assert client.cancelled == 1 and "stopped" in status


def test_panes_open_close_and_broadcast(history):
    client = FakeClient("hi")

    async def go():
        app = MinibatchChat(client, history)
        async with app.run_test(size=(140, 40)) as pilot:
            for _ in range(6):
                await pilot.press("ctrl+n")
            await pilot.pause()
            assert len(app.panes()) == 6  # capped at six
            await pilot.press("ctrl+w")
            await pilot.press("ctrl+w")
            await pilot.pause()
            assert len(app.panes()) == 4
            for ch in "all":
                await pilot.press(ch)
            await pilot.press("ctrl+b")
            await wait_until(pilot, lambda: all(len(p.messages) == 2 and not p.busy for p in app.panes()))
            return len(client.chats)

    assert asyncio.run(go()) == 4
    assert len(history.panes()) == 4


def test_focus_moves_between_panes(history):
    async def go():
        app = MinibatchChat(FakeClient(), history)
        async with app.run_test(size=(140, 40)) as pilot:
            await pilot.press("ctrl+n")
            await pilot.press("ctrl+n")
            await pilot.pause()
            order = [app.focused_pane().index]
            await pilot.press("tab")
            order.append(app.focused_pane().index)
            await pilot.press("shift+tab")
            order.append(app.focused_pane().index)
            await pilot.press("alt+right")
            order.append(app.focused_pane().index)
            return order

    assert asyncio.run(go()) == [2, 0, 2, 2]  # alt+right from the last pane stays put


def test_mode_toggle_is_shown_only_when_the_daemon_confirms(history):
    client = FakeClient()

    async def go():
        app = MinibatchChat(client, history)
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_until(pilot, lambda: client.events_queue is not None)
            client.events_queue.put_nowait(event(mode="continuous", running=2, used=8))
            await wait_until(pilot, lambda: "continuous" in str(app.query_one("#engine-mode").render()))
            await pilot.press("ctrl+t")
            await wait_until(pilot, lambda: client.modes == ["static"])
            await pilot.pause(0.5)  # a frame or two of the panel's: still the daemon's mode
            still = str(app.query_one("#engine-mode").render())
            client.events_queue.put_nowait(event(mode="static", running=2, used=8, step=2))
            await wait_until(pilot, lambda: "static" in str(app.query_one("#engine-mode").render()))
            after = str(app.query_one("#engine-mode").render())
            batch = str(app.query_one("#engine-batch").render())
            return still, after, batch

    still, after, batch = asyncio.run(go())
    assert "continuous" in still and "static" in after and "batch  2/8" in batch


def test_disconnect_shows_reconnecting_then_recovers(history):
    client = FakeClient()

    async def go():
        app = MinibatchChat(client, history)
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_until(pilot, lambda: client.events_queue is not None)
            client.connected = False
            from minibatch.tui.client import DaemonUnavailable

            client.events_queue.put_nowait(DaemonUnavailable("connection reset"))
            await wait_until(pilot, lambda: "reconnecting" in str(app.query_one("#engine-mode").render()))
            pane_status = str(app.panes()[0].query_one(".pane-status").render())
            client.connected = True
            client.events_queue = None
            await wait_until(pilot, lambda: client.events_queue is not None, timeout=5)
            client.events_queue.put_nowait(event())
            await wait_until(pilot, lambda: "reconnecting" not in str(app.query_one("#engine-mode").render()))
            return pane_status, str(app.panes()[0].query_one(".pane-status").render())

    during, after = asyncio.run(go())
    assert "reconnecting" in during and after == "ready"


def test_an_answer_keeps_its_numbers_over_a_reconnect_and_a_model_not_loaded_yet(history):
    """A pane that finished says how it went until the next answer: the events of a model that is not loaded
    yet leave it be (the panel says the model loads with the first message); a lost connection shows while it
    lasts, and the numbers come back with the daemon."""
    from minibatch.tui.client import DaemonUnavailable, ModelNotLoaded

    client = FakeClient("Paris.")

    async def go():
        app = MinibatchChat(client, history)
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_until(pilot, lambda: client.events_queue is not None)
            client.events_queue.put_nowait(event())
            await type_and_send(pilot, "capital?")
            pane = app.panes()[0]
            await wait_until(pilot, lambda: not pane.busy and len(pane.messages) == 2)
            client.events_queue.put_nowait(ModelNotLoaded("qwen2.5:0.5b"))
            mode_line = app.query_one("#engine-mode")
            await wait_until(pilot, lambda: "loads with the first message" in str(mode_line.render()))
            not_loaded = str(pane.query_one(".pane-status").render())
            client.events_queue.put_nowait(event(step=2))
            await wait_until(pilot, lambda: "continuous" in str(app.query_one("#engine-mode").render()))
            client.events_queue.put_nowait(DaemonUnavailable("connection reset"))
            await wait_until(pilot, lambda: "reconnecting" in str(app.query_one("#engine-mode").render()))
            away = str(pane.query_one(".pane-status").render())
            client.events_queue.put_nowait(event(step=3))
            await wait_until(pilot, lambda: "reconnecting" not in str(app.query_one("#engine-mode").render()))
            return not_loaded, away, str(pane.query_one(".pane-status").render())

    not_loaded, away, back = asyncio.run(go())
    assert "TTFT 12 ms" in not_loaded and "reconnecting" in away and "TTFT 12 ms" in back


def test_settings_modal_applies_and_persists(history):
    client = FakeClient("x")

    async def go():
        app = MinibatchChat(client, history)
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.press("ctrl+s")
            await wait_until(pilot, lambda: isinstance(app.screen, SettingsScreen))
            screen = app.screen
            screen.query_one("#set-temperature").value = "0"
            screen.query_one("#set-max_tokens").value = "64"
            screen.query_one("#set-seed").value = "7"
            screen.query_one("#set-system_prompt").value = "Be brief."
            await pilot.click("#save")
            await wait_until(pilot, lambda: not isinstance(app.screen, SettingsScreen))
            app.panes()[0].focus_input()
            await type_and_send(pilot, "q")
            await wait_until(pilot, lambda: client.params and not app.panes()[0].busy)

    asyncio.run(go())
    assert client.params[0] == {"temperature": 0.0, "top_p": 0.95, "max_tokens": 64, "seed": 7}
    assert client.chats[0][0] == {"role": "system", "content": "Be brief."}
    assert history.panes()[0].settings == PaneSettings("Be brief.", 0.0, 0.95, 64, 7)


def test_settings_validation_names_the_field():
    with pytest.raises(ValueError, match="temperature.*between 0 and 2"):
        parse_settings(
            {"model": "", "system_prompt": "", "temperature": "3", "top_p": "1", "max_tokens": "5", "seed": ""}
        )
    with pytest.raises(ValueError, match="max tokens.*: not a valid int"):
        parse_settings(
            {"model": "", "system_prompt": "", "temperature": "1", "top_p": "1", "max_tokens": "lots", "seed": ""}
        )
    ok = {"model": " qwen2.5:0.5b ", "system_prompt": "", "temperature": "1", "top_p": "1", "max_tokens": "9"}
    assert parse_settings({**ok, "seed": ""}).model == "qwen2.5:0.5b"
    assert parse_settings({**ok, "model": "", "seed": ""}).model is None  # the daemon's own


def test_help_screen_and_clear(history):
    client = FakeClient("y")

    async def go():
        app = MinibatchChat(client, history)
        async with app.run_test(size=(100, 30)) as pilot:
            await type_and_send(pilot, "x")
            pane = app.panes()[0]
            await wait_until(pilot, lambda: not pane.busy and pane.messages)
            await pilot.press("f1")
            await pilot.pause()
            shown = type(app.screen).__name__
            await pilot.press("escape")
            await pilot.press("ctrl+l")
            await pilot.pause()
            return shown, transcript_texts(pane)

    shown, texts = asyncio.run(go())
    assert shown == "HelpScreen" and texts == [] and history.panes()[0].messages == []


def test_block_map_colours_cells_by_pane():
    blocks = {"total": 8, "owners": {"a": [1, 2], "b": [3]}, "shared": [2]}
    cells = block_map_cells(blocks, {"a": 0, "b": 4}, cells=8)
    assert cells[:4] == [
        ("used", 0, False, None),
        ("used", 0, True, None),
        ("used", 4, False, None),
        ("free", None, False, None),
    ]
    grouped = block_map_cells({"total": 8, "owners": {"a": [1, 2, 3]}, "shared": []}, {"a": 1}, cells=4)
    assert grouped == [("used", 1, False, None)] * 2 + [("free", None, False, None)] * 2
    # an embedding's blocks are marked as such (the daemon lists which owners are embeddings)
    mixed = {"total": 4, "owners": {"e": [1, 2], "a": [3]}, "shared": [], "embeddings": ["e"]}
    assert block_map_cells(mixed, {"a": 2}, cells=4)[:3] == [
        ("embedding", None, False, None),
        ("embedding", None, False, None),
        ("used", 2, False, None),
    ]


def test_block_map_marks_the_blocks_of_requests_under_lora_adapters():
    """A request under an adapter: its blocks show the adapter's letter (by name, as in the timeline), named in
    a legend line; the base's blocks stay squares."""
    blocks = {
        "total": 6,
        "owners": {"a": [1, 2], "b": [3], "c": [4]},
        "shared": [],
        "adapters": {"a": "tone", "b": "sql"},
    }
    cells = block_map_cells(blocks, {"a": 0}, cells=6)
    assert [c[3] for c in cells] == ["tone", "tone", "sql", None, None, None]
    panel = EnginePanel(["red"])
    panel.update_blocks(blocks, {"a": 0})
    plain = panel._map.plain
    assert "LoRA a sql  b tone" in plain and "bba■" in plain, plain
    spans = {(plain[s.start : s.end], str(s.style)) for s in panel._map.spans if s.end - s.start == 1}
    assert ("b", "bold red") in spans and ("a", "bold grey70") in spans


def test_the_panel_counts_a_vision_models_images():
    from minibatch.tui.widgets.engine_panel import image_line

    busy = image_line({"images_queued": 2, "images_encoded": 4, "image_hits": 1, "image_seconds": 10.0})
    assert "encoding 2" in busy and "4 encoded" in busy and "1 again" in busy and "2.5 s each" in busy
    idle = image_line({"images_queued": 0, "images_encoded": 0, "image_hits": 0, "image_seconds": 0.0})
    assert "encoding" not in idle and "0 encoded" in idle


def test_status_line_numbers():
    s = format_status(
        {"ttft_ms": 250.0, "decode_ms": 1000.0, "queue_wait_ms": 5.0, "cached_prompt_tokens": 32}, 21, 1.3, "length"
    )
    assert s == "TTFT 250 ms · 20.0 tok/s · 21 tok · length · queue 5 ms · cached 32"


def test_panel_names_the_model_its_weights_and_device(history):
    client = FakeClient()

    async def go():
        app = MinibatchChat(client, history)
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_until(pilot, lambda: client.events_queue is not None)
            client.events_queue.put_nowait(event(mode="continuous", running=1, used=4))
            panel = app.query_one(EnginePanel)
            await wait_until(pilot, lambda: bool(panel.border_subtitle))
            return str(panel.border_subtitle)

    assert asyncio.run(go()) == "fake-model · Q4_1 native · cpu"


def test_panel_names_the_daemon_it_talks_to(history):
    client = FakeClient()

    async def go():
        app = MinibatchChat(client, history)
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_until(pilot, lambda: client.events_queue is not None)
            client.events_queue.put_nowait(event(mode="continuous", running=1, used=4))
            panel = app.query_one(EnginePanel)
            await wait_until(pilot, lambda: "engine ·" in str(panel.border_title))
            return str(panel.border_title)

    assert asyncio.run(go()) == "engine · …tch/minibatchd.sock"  # the tail of a long path


def scripted_steps(n: int) -> list[dict]:
    """Four requests per batch in rows 0-3: continuous for the first half, then static with padding rows."""
    out = []
    for step in range(1, n + 1):
        static = step > n // 2
        rows = []
        for row in range(4):
            rid = f"req-{row}"
            if static and (step % 20) > 5 + 3 * row:
                rows.append([row, rid, 1, "x"])
            else:
                rows.append([row, rid, 5 if step % 20 == 1 else 1, "p" if step % 20 == 1 else "d"])
        out.append(step_record(step, rows, "static" if static else "continuous", waiting=step % 3))
    return out


def test_timeline_keeps_up_with_1000_steps_without_blocking_input(history):
    client = FakeClient()
    client.step_records = scripted_steps(1000)

    async def go():
        app = MinibatchChat(client, history, poll_interval=0.01)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_until(pilot, lambda: client.events_queue is not None)
            panel = app.query_one(EnginePanel)
            assert not panel.showing_timeline and panel.query_one("#engine-map").display
            await pilot.press("ctrl+g")
            assert panel.showing_timeline and not panel.query_one("#engine-map").display
            for ch in "still typing":  # input is handled while the timeline catches up
                await pilot.press(ch if ch != " " else "space")
            await wait_until(pilot, lambda: panel.timeline.last_step == 1000, timeout=20)
            typed = app.panes()[0].pending_input()
            rendered = str(panel.timeline.render())
            drawn_cols = len(next(line for line in rendered.splitlines() if line.startswith("  0  "))) - 5
            await pilot.press("ctrl+g")
            back = panel.query_one("#engine-map").display and not panel.showing_timeline
            return typed, rendered, back, client.steps_calls, drawn_cols

    typed, rendered, back, calls, cols = asyncio.run(go())
    assert cols >= 20  # the panel's width in steps
    assert typed == "still typing" and back
    assert calls >= 5  # 200 records per answer: the poll followed them in pages
    lines = rendered.splitlines()
    assert lines[0].startswith("batch timeline")
    mode_line = next(line for line in lines if line.startswith("mode "))
    assert set(mode_line[5:]) == {"s"}  # the last steps are all static
    rows = [line for line in lines if line[:3].strip().isdigit()]
    assert len(rows) == 4 and all("╳" in r for r in rows[:3]) and "█" in rows[0]
    assert any(line.startswith("wait ") for line in lines)


def test_timeline_shows_the_mode_switch_and_pane_colours():
    from minibatch.tui.widgets.timeline import render_timeline

    recs = [
        step_record(1, [[0, "a", 3, "p"], [1, "b", 2, "p"]]),
        step_record(2, [[0, "a", 1, "d"], [1, "b", 1, "d"]]),
        step_record(3, [[0, "a", 1, "x"], [1, "b", 1, "d"]], mode="static", waiting=12),
    ]
    text = render_timeline(recs, {"a": 0}, ["red", "blue"], cols=30, height=20)
    plain = str(text)
    assert "mode ccs" in plain and "  0  ▒█╳" in plain and "  1  ▒██" in plain and "wait   +" in plain
    cells = {(text.plain[s.start : s.end], str(s.style)) for s in text.spans if s.end - s.start == 1}
    # a's cells in pane 0's colour, b (another client) grey, padding red
    assert {("▒", "red"), ("█", "red"), ("▒", "grey62"), ("█", "grey62"), ("╳", "red")} <= cells


def test_timeline_marks_rows_under_lora_adapters_by_letter():
    from minibatch.tui.widgets.timeline import render_timeline

    recs = [
        {**step_record(1, [[0, "a", 3, "p"], [1, "b", 2, "p"], [2, "c", 2, "p"]]), "adapters": {"a": "tone"}},
        {
            **step_record(2, [[0, "a", 1, "d"], [1, "b", 1, "d"], [2, "c", 1, "d"]]),
            "adapters": {"a": "tone", "b": "sql"},
        },
    ]
    text = render_timeline(recs, {"a": 0}, ["red"], cols=30, height=20)
    plain = str(text)
    # letters by name (the block map's too): a decodes as tone's, b as sql's, c (the base) as a plain decode;
    # prefill keeps its mark
    assert "LoRA a sql  b tone" in plain and "  0  ▒b" in plain and "  1  ▒a" in plain and "  2  ▒█" in plain
    cells = {(text.plain[s.start : s.end], str(s.style)) for s in text.spans if s.end - s.start == 1}
    assert ("b", "bold red") in cells and ("a", "bold grey62") in cells
    assert "LoRA" not in str(render_timeline([step_record(1, [[0, "a", 1, "d"]])], {}, ["red"], cols=30, height=20))


def test_timeline_marks_rows_that_took_several_tokens_by_speculation():
    from minibatch.tui.widgets.engine_panel import speculation_line
    from minibatch.tui.widgets.timeline import render_timeline

    recs = [
        step_record(1, [[0, "a", 3, "p", 0, 0]]),
        step_record(2, [[0, "a", 5, "v", 4, 2]]),  # verified 4 draft tokens, kept 2: took 3 tokens
        step_record(3, [[0, "a", 5, "d", 4, 0]]),  # verified 4, kept none: one token, a plain decode mark
        step_record(4, [[0, "a", 13, "v", 12, 12]]),  # 13 tokens in one step: "+"
    ]
    text = render_timeline(recs, {"a": 0}, ["red"], cols=30, height=20)
    plain = str(text)
    assert "  0  ▒3█+" in plain and "2-9 tokens a row took (speculation)" in plain
    cells = {(text.plain[s.start : s.end], str(s.style)) for s in text.spans if s.end - s.start == 1}
    assert ("3", "bold reverse red") in cells
    # without a verified row the legend line stays away
    assert "speculation" not in str(render_timeline(recs[:1], {"a": 0}, ["red"], cols=30, height=20))
    assert speculation_line({"acceptance_rate": 0.625, "tokens_per_verify_row": 2.4}) == "spec accept  62%  2.4 tok/row"
    assert speculation_line({"acceptance_rate": None}) is None
    from minibatch.tui.widgets.chat_pane import format_status

    status = format_status({"ttft_ms": 5.0, "draft_tokens": 10, "accepted_tokens": 6}, 12, 1.0, "stop")
    assert status.endswith("spec 6/10") and "spec" not in format_status({"draft_tokens": 0}, 3, 1.0, "stop")


class BurstClient(FakeClient):
    """Every pane's answer arrives as fast as the loop runs: `tokens` chunks with no pause between them."""

    def __init__(self, tokens: int) -> None:
        super().__init__()
        self.tokens = tokens

    async def chat(self, messages, **params):
        rid = f"req-{self.next_id}"
        self.next_id += 1
        yield Delta(request_id=rid)
        for i in range(self.tokens):
            yield Delta(text=burst_token(i))
        yield Delta(finish_reason="length", timings={"ttft_ms": 1.0, "decode_ms": 10.0})


def burst_token(i: int) -> str:
    """Markdown in pieces: paragraphs, a list, bold words and a fenced block across chunk boundaries."""
    parts = ["Word", " **bold**", " and", " more", ".\n\n", "- item", " one\n", "```py\nx = 1\n", "```\n\n", " end"]
    return parts[i % len(parts)]


def test_a_burst_into_four_panes_draws_few_frames_and_the_same_transcripts(history):
    """2,000 tokens into four panes at once: each pane draws them in a few frames, never one per token, and
    ends with exactly the transcript a pane shows when given the whole answer at once."""
    from minibatch.tui.frames import FRAME_MIN_S

    client = BurstClient(500)

    async def go():
        for i in range(4):
            history.new_pane(i, PaneSettings())
        app = MinibatchChat(client, history)
        async with app.run_test(size=(160, 48)) as pilot:
            for i, pane in enumerate(app.panes()):
                pane.query_one("Input").value = f"prompt {i}"
            started = asyncio.get_running_loop().time()
            await pilot.press("ctrl+b")
            await wait_until(pilot, lambda: all(len(p.messages) == 2 and not p.busy for p in app.panes()), 30)
            elapsed = asyncio.get_running_loop().time() - started
            drawn = [p.transcript.plain_lines() for p in app.panes()]
            flushes = [p.flushes for p in app.panes()]
            # the reference: the same answer set whole into a transcript, as token-by-token drawing ends
            ref_pane = app.panes()[0]
            t = ref_pane.transcript
            answer = "".join(burst_token(i) for i in range(500))
            t.clear()
            t.add("user", "prompt 0")
            t.add("assistant", answer)
            return drawn, flushes, elapsed, t.plain_lines(), app.frames

    drawn, flushes, elapsed, reference, frames = asyncio.run(go())
    assert len(drawn) == 4 and drawn[0] == reference
    assert all(d[1:] == reference[1:] for d in drawn)  # the same answer in every pane under its own prompt
    bound = elapsed / FRAME_MIN_S + 2  # at most one transcript update a frame, plus the final one
    assert all(1 <= f <= bound for f in flushes), (flushes, bound)
    assert all(f < 500 / 10 for f in flushes)  # never anywhere near one per token
    assert frames >= 1


class PacedClient(FakeClient):
    """An answer of `lines` short paragraphs, one chunk each, 0.12 s apart: at most four chunks (eight lines)
    a frame even at the slowest frame rate, fewer than a jump's third of a 40-row view."""

    def __init__(self, lines: int) -> None:
        super().__init__()
        self.lines = lines

    async def chat(self, messages, **params):
        yield Delta(request_id="req-paced")
        for i in range(self.lines):
            await asyncio.sleep(0.12)
            yield Delta(text=f"line {i}\n\n")
        yield Delta(finish_reason="stop", timings={"ttft_ms": 1.0, "decode_ms": 10.0})


def test_a_long_answer_is_followed_in_jumps_of_a_third_of_the_view(history):
    """The view follows an answer longer than the pane to its last line, and scrolls a third of its
    height ahead at a time, not a line per line (a scroll repaints every row), without laying out the
    screen for it."""
    from textual.screen import Screen

    from minibatch.tui.widgets.transcript import JUMP

    client = PacedClient(40)  # 40 paragraphs: 80 lines into a pane of 30-odd rows
    layouts = []

    async def go():
        history.new_pane(0, PaneSettings())
        app = MinibatchChat(client, history)
        async with app.run_test(size=(120, 40)) as pilot:
            pane = app.panes()[0]
            t = pane.transcript
            positions = []
            t.watch(t, "scroll_y", lambda y: positions.append(y), init=False)
            pane.query_one("Input").value = "a long one"
            refresh_layout = Screen._refresh_layout

            def counted(screen, *a, **k):
                layouts.append(app.frames)  # the frame clock tick it came after
                return refresh_layout(screen, *a, **k)

            await pilot.pause(0.2)
            Screen._refresh_layout = counted
            try:
                await pilot.press("enter")
                await wait_until(pilot, lambda: len(pane.messages) == 2 and not pane.busy, 30)
                await pilot.pause(0.2)
            finally:
                Screen._refresh_layout = refresh_layout
            height = t.scrollable_content_region.height
            last = len(t.plain_lines()) - 1  # the blank line after the answer
            return positions, height, t.scroll_offset.y, last, app.frames

    positions, height, top, last, frames = asyncio.run(go())
    assert top <= last - 1 < top + height  # the answer's last line is in view
    step = height // JUMP
    moves = [b - a for a, b in zip([0.0, *positions], positions)]
    assert moves and all(m >= step for m in moves), (moves, step)  # never a line at a time
    assert len(positions) <= (last - height) // step + 2, (len(positions), last, height)
    # layouts after the submitted input and when the scrollbar appeared (with the rounds that sets off): in two
    # frames of many, not in every frame
    assert len(set(layouts)) <= 2 < frames, (layouts, frames)


def test_full_collections_wait_until_the_answers_end(history):
    """While answers stream the garbage collector's oldest generation is left alone (a full collection
    walks every cached line); the frame after the last answer ends collects it; the app gives the
    collector its thresholds back when it closes."""
    import gc

    before = gc.get_threshold()
    client = PacedClient(30)
    full: list[bool] = []  # a full collection: was an answer streaming?
    app_ref = []

    def seen(phase, info):
        if phase == "start" and info["generation"] == 2 and app_ref:
            full.append(any(p.busy for p in app_ref[0].panes()))

    async def go():
        history.new_pane(0, PaneSettings())
        app = MinibatchChat(client, history)
        async with app.run_test(size=(120, 40)) as pilot:
            pane = app.panes()[0]
            assert gc.get_threshold()[2] > 10**6
            pane.query_one("Input").value = "go"
            await pilot.pause(0.2)
            app_ref.append(app)
            gc.callbacks.append(seen)
            try:
                await pilot.press("enter")
                await wait_until(pilot, lambda: pane.busy, 5)
                for _ in range(3):
                    await pilot.pause(0.2)
                    gc.collect(1)  # the young generations as the allocations would; never a full one
                await wait_until(pilot, lambda: len(pane.messages) == 2 and not pane.busy, 30)
                await wait_until(pilot, lambda: bool(full), 5)
            finally:
                gc.callbacks.remove(seen)

    asyncio.run(go())
    assert full and not any(full), full  # collected, and only once nothing streamed
    assert gc.get_threshold() == before


def test_the_panel_says_when_the_machine_is_busy(history):
    from minibatch.tui.widgets.engine_panel import contention_line

    client = FakeClient()

    async def go():
        app = MinibatchChat(client, history)
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_until(pilot, lambda: client.events_queue is not None)
            numbers = app.query_one("#engine-numbers")
            client.events_queue.put_nowait({**event(running=2, step=2), "cpu_wait_share": 0.02})
            await wait_until(pilot, lambda: app.panel.drawn_step == 2)
            free = str(numbers.render())
            client.events_queue.put_nowait({**event(running=2, step=3), "cpu_wait_share": 0.41})
            await wait_until(pilot, lambda: app.panel.drawn_step == 3)
            busy = str(numbers.render())
            client.events_queue.put_nowait({**event(running=2, step=4), "cpu_wait_share": None})
            await wait_until(pilot, lambda: app.panel.drawn_step == 4)
            return free, busy, str(numbers.render())

    free, busy, unknown = asyncio.run(go())
    assert "cpu wait   2% cores free" in free and "busy" not in free
    assert "cpu wait  41% machine busy elsewhere" in busy
    assert "cpu wait" not in unknown  # a system that does not count it: no line rather than a guess
    # its row stays, blank: the panel keeps its height, so a hint that comes and goes lays nothing out again
    assert free.count("\n") == busy.count("\n") == unknown.count("\n")
    assert contention_line(0.0999).endswith("cores free[/]") and "busy" in contention_line(0.1)


def test_the_panel_draws_only_the_newest_event_at_its_rate(history):
    client = FakeClient()

    async def go():
        app = MinibatchChat(client, history)
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_until(pilot, lambda: client.events_queue is not None)
            for step in range(1, 201):  # 200 events in one burst
                client.events_queue.put_nowait(event(running=step % 8, used=step % 60, step=step))
            await wait_until(pilot, lambda: app.panel.drawn_step == 200)
            before = app.panel.redraws
            await pilot.pause(1.0)  # nothing new: nothing drawn
            return before, app.panel.redraws, str(app.query_one("#engine-batch").render())

    before, after, batch = asyncio.run(go())
    assert before <= 5 and after == before
    assert "batch  0/8" in batch  # the newest event (step 200: 200 % 8 running)


def test_a_replica_that_joins_the_merged_events_is_drawn(history):
    """Behind an ingress each event merges every replica's latest; one whose replica joins idle keeps the
    step (the busiest replica's) and must still be drawn."""
    from minibatch.daemon.cluster.aggregate import event as merged

    client = FakeClient()
    busy, idle = {**event(running=1, step=40), "replica": "a"}, {**event(step=3), "replica": "b"}

    async def go():
        app = MinibatchChat(client, history)
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_until(pilot, lambda: client.events_queue is not None)
            client.events_queue.put_nowait(merged({"a": busy}, 0.0))
            await wait_until(pilot, lambda: "1 replica" in str(app.panel.lines["engine-replicas"].render()))
            client.events_queue.put_nowait(merged({"a": busy, "b": idle}, 0.1))
            await wait_until(pilot, lambda: "2 replicas" in str(app.panel.lines["engine-replicas"].render()))
            return app.panel.drawn_step, str(app.panel.lines["engine-batch"].render())

    step, batch = asyncio.run(go())
    assert step == 40 and "batch  1/16" in batch  # both replicas' rows


def test_a_pane_picks_its_model_and_the_panel_follows_it(history):
    """ctrl+o lists the daemon's models; the pick goes into the pane's requests, its title and the history,
    and the panel's event stream switches to that model (whose lines then show every loaded model)."""
    client = FakeClient("ok")

    async def go():
        app = MinibatchChat(client, history)
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_until(pilot, lambda: client.events_queue is not None)
            await pilot.press("ctrl+o")
            await wait_until(pilot, lambda: app.screen.__class__.__name__ == "ModelScreen")
            await pilot.press("down", "down", "enter")  # the daemon's own, fake-model, qwen2.5:0.5b
            pane = app.panes()[0]
            await wait_until(pilot, lambda: pane.settings.model == "qwen2.5:0.5b")
            await wait_until(pilot, lambda: client.viewed and client.viewed[-1] == "qwen2.5:0.5b")
            assert "qwen2.5:0.5b" in str(pane.query_one(".pane-title").render())
            await type_and_send(pilot, "hi")
            await wait_until(pilot, lambda: not pane.busy and pane.messages)
            models = {
                "fake-model": {"state": "ready", "running": 1, "max_num_seqs": 8, "kv_usage_percent": 5.0},
                "qwen2.5:0.5b": {"state": "loading"},
            }
            await client.events_queue.put({**event(running=1, step=9), "model": "qwen2.5:0.5b", "models": models})
            await wait_until(pilot, lambda: "2 models" in str(app.panel.lines["engine-models"].render()))
            lines = str(app.panel.lines["engine-models"].render())
            assert "▶qwen2.5:0.5b" in lines and "loading" in lines and " 1/8" in lines
        return client.params[-1]

    params = asyncio.run(go())
    assert params["model"] == "qwen2.5:0.5b"
    assert history.panes()[0].settings.model == "qwen2.5:0.5b"  # remembered with the conversation


def test_the_cursor_holds_still_while_an_answer_streams(history):
    """A blinking cursor redraws the screen twice a second on its own: while any pane streams, no input
    blinks; once none does, they blink again."""
    client = FakeClient("a long answer", hold=True)

    async def go():
        history.new_pane(0, PaneSettings())
        history.new_pane(1, PaneSettings())
        app = MinibatchChat(client, history)
        async with app.run_test(size=(120, 36)) as pilot:
            first, second = app.panes()
            before = [p.input.cursor_blink for p in (first, second)]
            await type_and_send(pilot, "talk")
            await wait_until(pilot, lambda: "long" in "".join(transcript_texts(first)))
            await wait_until(pilot, lambda: not second.input.cursor_blink)
            during = [p.input.cursor_blink for p in (first, second)]
            client.release.set()
            await wait_until(pilot, lambda: not first.busy)
            await wait_until(pilot, lambda: first.input.cursor_blink and second.input.cursor_blink)
            return before, during

    before, during = asyncio.run(go())
    assert before == [True, True] and during == [False, False]


def test_the_block_map_is_drawn_in_the_panels_frame():
    """A new block map waits for the panel's next redraw (the frame clock's), and an unchanged one is not
    drawn again."""
    from textual.app import App

    class Host(App):
        def compose(self):
            yield EnginePanel(["#e06c75", "#61afef"], id="engine")

    blocks = {"total": 8, "owners": {"r0": [1, 2]}, "shared": []}

    async def go():
        app = Host()
        async with app.run_test(size=(60, 40)) as pilot:
            panel = app.query_one(EnginePanel)
            shown = app.query_one("#engine-map")
            empty = str(shown.render())
            panel.update_blocks(blocks, {"r0": 1})
            await pilot.pause()
            waiting = str(shown.render())
            panel.redraw()
            await pilot.pause()
            drawn = str(shown.render())
            panel.update_blocks(blocks, {"r0": 1})  # the same map: nothing to draw
            again = panel._map
            return empty, waiting, drawn, again

    empty, waiting, drawn, again = asyncio.run(go())
    assert waiting == empty and "KV block map" in drawn and "■" in drawn and again is None


def test_the_panel_counts_prefix_hits_and_those_read_from_disk(history):
    client = FakeClient()

    async def go():
        app = MinibatchChat(client, history)
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_until(pilot, lambda: client.events_queue is not None)
            numbers = app.query_one("#engine-numbers")
            client.events_queue.put_nowait({**event(running=1, step=2), "prefix_hit_blocks": 3})
            await wait_until(pilot, lambda: app.panel.drawn_step == 2)
            memory = str(numbers.render())
            client.events_queue.put_nowait({**event(running=1, step=3), "prefix_hit_blocks": 9, "disk_hit_blocks": 9})
            await wait_until(pilot, lambda: app.panel.drawn_step == 3)
            disk = str(numbers.render())
            client.events_queue.put_nowait({**event(running=1, step=4), "reused_tokens": 420})
            await wait_until(pilot, lambda: app.panel.drawn_step == 4)
            return memory, disk, str(numbers.render())

    memory, disk, shifted = asyncio.run(go())
    assert "prefix-cache hits 3 blocks" in memory and "disk" not in memory and "shifted" not in disk
    assert "prefix-cache hits 12 blocks, 9 disk" in disk
    assert "prefix-cache hits 12 blocks, 9 disk, 420 tok shifted" in shifted
    assert memory.count("\n") == disk.count("\n") == shifted.count("\n")

"""minibatch-chat: several chat panes at once beside a live view of the engine's batch."""

from __future__ import annotations

import asyncio
import gc
import time
from pathlib import Path

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal
from textual.widgets import Footer

from .client import DaemonUnavailable, ModelNotLoaded
from .frames import FRAME_MIN_S, FULL_GC_MAX_S, NO_FULL_GC, PANEL_S, POLL_S, STATUS_S, pace
from .history import History, PaneSettings
from .messages import PaneSubmitted, RequestOwner, TurnFinished
from .names import short_model_name
from .screens.attach import AttachScreen
from .screens.help import HelpScreen
from .screens.models import ModelScreen
from .screens.settings import SettingsScreen
from .widgets.chat_pane import PANE_COLORS, ChatPane
from .widgets.engine_panel import EnginePanel, kv_cache_text

MAX_PANES = 6
NARROW = 100  # below this many columns the engine panel moves under the panes


class MinibatchChat(App):
    CSS_PATH = "app.tcss"
    TITLE = "minibatch-chat"
    BINDINGS = [
        Binding("ctrl+b", "broadcast", "broadcast", priority=True),
        Binding("ctrl+n", "new_pane", "new pane", priority=True),
        Binding("ctrl+w", "close_pane", "close pane", priority=True),
        Binding("ctrl+t", "toggle_mode", "static⇄continuous", priority=True),
        Binding("ctrl+g", "toggle_timeline", "timeline", priority=True),
        Binding("ctrl+s", "settings", "settings", priority=True),
        Binding("ctrl+o", "pick_model", "model", priority=True),
        Binding("ctrl+f", "attach", "image", priority=True),
        Binding("ctrl+l", "clear_pane", "clear", priority=True),
        Binding("escape", "cancel", "stop answer"),
        Binding("f1,question_mark", "help", "help"),
        Binding("tab", "cycle(1)", "next pane", show=False, priority=True),
        Binding("shift+tab", "cycle(-1)", "previous pane", show=False, priority=True),
        Binding("alt+left", "move(-1, 0)", show=False),
        Binding("alt+right", "move(1, 0)", show=False),
        Binding("alt+up", "move(0, -1)", show=False),
        Binding("alt+down", "move(0, 1)", show=False),
        Binding("ctrl+q", "quit", "quit", priority=True),
    ]

    def __init__(self, client, history: History, poll_interval: float = POLL_S) -> None:
        super().__init__()
        self.client, self.history, self.poll_interval = client, history, poll_interval
        self.frames = 0  # frame clock ticks so far
        self.frame_interval = FRAME_MIN_S  # follows the chat's CPU use (frames.pace)
        self._clock = (time.monotonic(), time.process_time(), 0.0, 0.0)  # last frame: wall, CPU; panel, status drawn
        self._gc_threshold: tuple[int, int, int] | None = None  # the collector's own, while the app holds it back
        self._full_gc_at, self._streamed = time.monotonic(), False  # the last full collection; answers since
        self.panel = EnginePanel(PANE_COLORS, id="engine")
        self.grid = Grid(id="panes")
        self.owners: dict[str, int] = {}  # request id -> pane index, for the block map
        self.request_panes: dict[str, int] = {}  # every request id seen -> pane index, for the timeline (bounded)
        self.mode: str | None = None
        self.view_model: str | None = None  # the model the panel shows: the focused pane's (None: the daemon's own)

    # -- layout -----------------------------------------------------------
    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            yield self.grid
            yield self.panel
        yield Footer()

    async def on_mount(self) -> None:
        stored = self.history.panes()
        if not stored:
            await self._add_pane(self.history.new_pane(0), PaneSettings(), [])
        for p in stored[:MAX_PANES]:
            await self._add_pane(p.id, p.settings, p.messages)
        self.panes()[0].focus_input()
        self.watch_events()
        self.poll_blocks()
        self._gc_threshold = gc.get_threshold()
        gc.set_threshold(*self._gc_threshold[:2], NO_FULL_GC)  # full collections at the frame clock's choosing
        self.set_timer(self.frame_interval, self._frame)

    def _frame(self) -> None:
        """The frame clock: streamed text into every pane, the panel every PANEL_S, then the next frame
        after an interval paced by the chat's own CPU use."""
        self.frames += 1
        now, cpu = time.monotonic(), time.process_time()
        wall_then, cpu_then, panel_at, status_at = self._clock
        self.frame_interval = pace(self.frame_interval, (cpu - cpu_then) / max(now - wall_then, 1e-3))
        panel_due, status_due = now - panel_at >= PANEL_S, now - status_at >= STATUS_S
        panes = self.panes()
        # a blinking cursor is two screen updates a second of its own: steady while any answer streams
        blink = not any(p.busy for p in panes)
        for pane in panes:
            pane.flush(status=status_due)
            if pane.input.cursor_blink != blink:
                pane.input.cursor_blink = blink
        if panel_due:
            self.panel.redraw()
        self._streamed |= not blink
        if (blink and self._streamed) or (now - self._full_gc_at > FULL_GC_MAX_S and gc.get_count()[2]):
            gc.collect()  # the answers have ended (or it is overdue): the full collection they held back
            self._full_gc_at, self._streamed = now, False
        self._clock = (now, cpu, now if panel_due else panel_at, now if status_due else status_at)
        self.set_timer(self.frame_interval, self._frame)

    def panes(self) -> list[ChatPane]:
        # the grid's own children (no query: the frame clock asks this while the app shuts down too)
        return [c for c in self.grid.children if isinstance(c, ChatPane)]

    async def _add_pane(self, pane_id: int, settings: PaneSettings, messages: list[dict]) -> ChatPane:
        pane = ChatPane(pane_id, len(self.panes()), settings, messages)
        await self.grid.mount(pane)
        self._relayout()
        return pane

    def _columns(self) -> int:
        n = len(self.panes())
        narrow = self.size.width < NARROW
        return 1 if n == 1 else 2 if n <= 4 or narrow else 3

    def _relayout(self) -> None:
        grid = self.grid
        cols = self._columns()
        grid.styles.grid_size_columns = cols
        grid.styles.grid_size_rows = -(-len(self.panes()) // cols)

    def on_resize(self) -> None:
        self.screen.set_class(self.size.width < NARROW, "narrow")
        self._relayout()

    def focused_pane(self) -> ChatPane:
        node = self.focused
        while node is not None and not isinstance(node, ChatPane):
            node = node.parent
        return node if isinstance(node, ChatPane) else self.panes()[0]

    # -- chatting ---------------------------------------------------------
    @on(PaneSubmitted)
    def _submitted(self, event: PaneSubmitted) -> None:
        pane = self.query_one(f"#pane-{event.pane_id}", ChatPane)
        pane.ask(self.client, event.text)

    @on(TurnFinished)
    def _turn_finished(self, event: TurnFinished) -> None:
        self.history.add_message(event.pane_id, "user", event.user, event.images)
        self.history.add_message(event.pane_id, "assistant", event.assistant)

    @on(RequestOwner)
    def _owner(self, event: RequestOwner) -> None:
        pane = next((p for p in self.panes() if p.pane_id == event.pane_id), None)
        if pane is None:  # closed (or the app is closing) before its request ended
            return
        for rid, idx in list(self.owners.items()):
            if idx == pane.index:
                del self.owners[rid]
        if event.request_id:
            self.owners[event.request_id] = pane.index
            self.request_panes[event.request_id] = pane.index
            if len(self.request_panes) > 4096:
                for rid in list(self.request_panes)[:1024]:
                    del self.request_panes[rid]

    def action_broadcast(self) -> None:
        """Every pane asks at once: its own pending input, else the focused pane's."""
        shared = self.focused_pane().pending_input()
        for pane in self.panes():
            text = pane.take_input() or shared
            if text and not pane.busy:
                pane.ask(self.client, text)

    def action_cancel(self) -> None:
        self.focused_pane().cancel()

    def action_clear_pane(self) -> None:
        pane = self.focused_pane()
        pane.clear()
        self.history.clear(pane.pane_id)

    async def action_new_pane(self) -> None:
        if len(self.panes()) >= MAX_PANES:
            self.notify(f"at most {MAX_PANES} panes", severity="warning")
            return
        pane = await self._add_pane(self.history.new_pane(len(self.panes())), PaneSettings(), [])
        pane.focus_input()

    async def action_close_pane(self) -> None:
        panes = self.panes()
        if len(panes) == 1:
            self.notify("the last pane stays open", severity="warning")
            return
        pane = self.focused_pane()
        pane.cancel()
        self.history.delete_pane(pane.pane_id)
        await pane.remove()
        for i, p in enumerate(self.panes()):
            p.index, p.color = i, PANE_COLORS[i % len(PANE_COLORS)]
            p.refresh_title()
        self._relayout()
        self.panes()[0].focus_input()

    def action_cycle(self, step: int) -> None:
        panes = self.panes()
        i = panes.index(self.focused_pane())
        panes[(i + step) % len(panes)].focus_input()

    def action_move(self, dx: int, dy: int) -> None:
        panes, cols = self.panes(), self._columns()
        i = panes.index(self.focused_pane()) + dx + dy * cols
        if 0 <= i < len(panes):
            panes[i].focus_input()

    def action_settings(self) -> None:
        pane = self.focused_pane()

        def apply(settings: PaneSettings | None) -> None:
            if settings is not None:
                pane.settings = settings
                pane.refresh_title()
                self.history.save_settings(pane.pane_id, settings)
                self.follow(pane)

        self.push_screen(SettingsScreen(pane.settings, f"pane {pane.index + 1} settings"), apply)

    @work(group="models")
    async def action_pick_model(self) -> None:
        """The focused pane's model, picked from what the daemon lists (loaded ones marked)."""
        pane = self.focused_pane()
        try:
            models = await self.client.models()
        except DaemonUnavailable as exc:
            self.notify(f"cannot list the models: {exc}", severity="error")
            return

        def apply(picked: str | None) -> None:
            if picked is None:
                return
            pane.settings.model = picked or None
            pane.refresh_title()
            self.history.save_settings(pane.pane_id, pane.settings)
            self.follow(pane)
            if picked and not any(m["id"] == picked and m.get("loaded") for m in models):
                pane.set_status(f"[dim]{picked} loads with the first message[/]")

        self.push_screen(ModelScreen(models, pane.settings.model, f"pane {pane.index + 1}: model"), apply)

    def on_descendant_focus(self) -> None:
        self.follow(self.focused_pane())

    def follow(self, pane: ChatPane) -> None:
        """The panel, its block map and timeline show the focused pane's model."""
        model = pane.settings.model
        if model == self.view_model:
            return
        self.view_model = model
        self.panel.timeline.clear()
        self.watch_events()  # (exclusive: the stream of the previous model ends)
        if self.panel.showing_timeline:
            self.poll_steps()

    def action_attach(self) -> None:
        """An image file for the focused pane's next message (its path asked for, with a preview)."""
        pane = self.focused_pane()

        def apply(path: Path | None) -> None:
            if path is not None:
                problem = pane.attach(path)
                if problem is not None:
                    self.notify(problem, severity="error")
            pane.focus_input()

        self.push_screen(AttachScreen(f"pane {pane.index + 1}: attach an image"), apply)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    @work(group="mode")
    async def action_toggle_mode(self) -> None:
        if self.mode is None:
            self.notify("not connected to the daemon yet", severity="warning")
            return
        target = "static" if self.mode == "continuous" else "continuous"
        try:
            await self.client.set_mode(target)
        except DaemonUnavailable as exc:
            self.notify(f"mode switch failed: {exc}", severity="error")
            return
        # The panel shows the new mode only when the daemon's events confirm it.
        self.notify(f"switching to {target} at the next batch boundary")

    def action_toggle_timeline(self) -> None:
        panel = self.panel
        if panel.toggle_timeline():
            self.poll_steps()

    # -- the engine view --------------------------------------------------
    @work(exclusive=True, group="events")
    async def watch_events(self) -> None:
        panel = self.panel
        while True:
            try:
                async for event in self.client.events(self.view_model):
                    if not panel.connected:  # (re)connected: the panes may ask again
                        for pane in self.panes():
                            pane.connection_back()
                    if not panel.connected or event.get("model") != panel.shown_model:
                        panel.shown_model = event.get("model")
                        await self.show_model(panel)
                    self.mode = event["mode"]
                    panel.update_stats(event)
            except ModelNotLoaded as exc:  # the daemon is there; the model loads with a pane's first message
                panel.set_not_loaded(str(exc))
            except DaemonUnavailable as exc:
                panel.set_disconnected(str(exc))
                for pane in self.panes():
                    pane.connection_lost()
            await asyncio.sleep(1.0)

    async def show_model(self, panel: EnginePanel) -> None:
        """What the chat is talking to (model, weight type, device), under the panel's title."""
        try:
            h = await self.client.health()
        except DaemonUnavailable:
            return
        facts = next((m for m in h.get("models", []) if m.get("name") == panel.shown_model), h)
        name = short_model_name(facts.get("name") or facts.get("model") or "")
        panel.border_subtitle = " · ".join(str(v) for v in (name, facts.get("weights"), facts.get("device")) if v)
        panel.kv_cache = kv_cache_text(facts)
        panel.set_target(getattr(self.client, "target", ""))

    @work(exclusive=True, group="blocks")
    async def poll_blocks(self) -> None:
        panel = self.panel
        while True:
            try:
                panel.update_blocks(await self.client.blocks(self.view_model), self.owners)
            except DaemonUnavailable:
                pass
            await asyncio.sleep(self.poll_interval)

    @work(exclusive=True, group="steps")
    async def poll_steps(self) -> None:
        """While the timeline shows: fetch the step records since the last one drawn."""
        panel = self.panel
        while panel.showing_timeline:
            try:
                panel.timeline.add(
                    await self.client.steps(panel.timeline.last_step, self.view_model), self.request_panes
                )
            except DaemonUnavailable:
                pass
            await asyncio.sleep(self.poll_interval)

    async def on_unmount(self) -> None:
        if self._gc_threshold is not None:
            gc.set_threshold(*self._gc_threshold)
        await self.client.close()

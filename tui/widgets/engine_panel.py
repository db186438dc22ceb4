"""The live view of the engine.

Mode, batch occupancy, KV cache, queue, rates, and a KV block map or the batch timeline.
"""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline, Static

from ..names import short_model_name
from .timeline import Timeline, adapter_letters

HISTORY = 180  # occupancy samples kept: one a panel redraw (frames.py), about a minute
MAP_CELLS = 96  # cells in the block map; each stands for one block or a group of blocks
BUSY_SHARE = 0.1  # engine threads waiting for a core this share of step time: say the machine is busy


def contention_line(share: float | None) -> str | None:
    """How much of the recent steps the engine's threads spent waiting for a core (None: not counted here)."""
    if share is None:
        return None
    if share < BUSY_SHARE:
        return f"cpu wait {100 * share:3.0f}% [dim]cores free[/]"
    return f"cpu wait [b yellow]{100 * share:3.0f}%[/] [yellow]machine busy elsewhere[/]"


def speculation_line(e: dict) -> str | None:
    """Speculative decoding over the last seconds: accepted / drafted and the tokens a verifying row took."""
    rate, per_row = e.get("acceptance_rate"), e.get("tokens_per_verify_row")
    if rate is None:
        return None
    return f"spec accept {100 * rate:3.0f}%  {per_row:.1f} tok/row"


def bar(fraction: float, width: int) -> str:
    filled = max(0, min(width, round(fraction * width)))
    return "█" * filled + "░" * (width - filled)


def block_map_cells(
    blocks: dict, owners: dict[str, int], cells: int = MAP_CELLS
) -> list[tuple[str, int | None, bool, str | None]]:
    """Per cell: ('free'|'used'|'embedding', pane index owning most of it or None, holds a shared block, the
    LoRA adapters the request holding most of it runs under ("+"-joined) or None); 'embedding' when that
    request is an embedding."""
    total = blocks.get("total", 0)
    if not total:
        return []
    per_cell = max(1, -(-total // cells))
    n_cells = -(-total // per_cell)
    owner_of: dict[int, str] = {}
    for rid, ids in blocks.get("owners", {}).items():
        for b in ids:
            owner_of[b] = rid
    shared = set(blocks.get("shared", []))
    embeddings = set(blocks.get("embeddings", []))
    adapters = blocks.get("adapters", {})
    out = []
    for c in range(n_cells):
        ids = range(1 + c * per_cell, 1 + min(total, (c + 1) * per_cell))  # block 0 is the null block
        held = [owner_of[b] for b in ids if b in owner_of]
        if not held:
            out.append(("free", None, False, None))
            continue
        top = max(set(held), key=held.count)
        kind = "embedding" if top in embeddings else "used"
        out.append((kind, owners.get(top), any(b in shared for b in ids), adapters.get(top)))
    return out


def image_line(e: dict) -> str:
    """A vision model's tower: images waiting for it or in it, those encoded, found again, time it took."""
    queued, done = e.get("images_queued", 0), e.get("images_encoded", 0)
    busy = f"[b yellow]encoding {queued}[/] · " if queued else ""
    per = f" · {e.get('image_seconds', 0) / done:.1f} s each" if done else ""
    return f"images  {busy}{done} encoded · {e.get('image_hits', 0)} again{per}"


def kv_cache_text(facts: dict) -> str:
    """A model's KV cache from its /health facts, short: type, bytes per token, tokens it holds."""
    if "kv_cache_type" not in facts:
        return ""
    per, tokens = facts["kv_bytes_per_token"], facts["kv_cache_tokens"]
    size = f"{per / 1024:.1f} KB" if per >= 1024 else f"{per} B"
    held = f"{tokens / 1000:.0f}k" if tokens >= 10_000 else str(tokens)
    return f"{facts['kv_cache_type']} · {size}/token · {held} tokens"


def replica_lines(replicas: list[dict]) -> str:
    """One compact line per replica: its id, batch occupancy and KV use, and its mode when it differs."""
    modes = {r.get("mode") for r in replicas}
    lines = [f"[b]{len(replicas)} replica{'s' if len(replicas) != 1 else ''}[/]"]
    for r in replicas:
        cap, total = r.get("max_num_seqs") or 0, r.get("kv_blocks_total") or 0
        running, used = r.get("running") or 0, r.get("kv_blocks_used") or 0
        mode = f" {r.get('mode')}" if len(modes) > 1 else ""
        lines.append(
            f"{r['replica'][:8]:<8} {running:>2}/{cap:<3}{bar(running / cap if cap else 0, 5)} "
            f"KV {bar(used / total if total else 0, 5)}{mode}"
        )
    return "\n".join(lines)


def model_lines(models: dict[str, dict], shown: str | None) -> str:
    """One compact line per loaded (or loading) model: its batch and KV use and its decode rate; the one the
    bars above show is marked."""
    lines = [f"[b]{len(models)} models[/] [dim](the bars: ▶)[/]"]
    for name, m in models.items():
        mark = "▶" if name == shown else " "
        label = f"{short_model_name(name)[:14]:<14}"
        if m.get("state") == "loading":
            lines.append(f"{mark}{label} [yellow]loading…[/]")
            continue
        cap, running = m.get("max_num_seqs") or 0, m.get("running") or 0
        lines.append(
            f"{mark}{label} {running:>2}/{cap:<2}{bar(running / cap if cap else 0, 4)} "
            f"KV{(m.get('kv_usage_percent') or 0):3.0f}% {m.get('decode_tokens_per_s') or 0:5.0f}t/s"
        )
    return "\n".join(lines)


class EnginePanel(Vertical):
    """Fed /v1/engine/events by the app (update_stats keeps the newest), drawn at the panel's rate (redraw)."""

    def __init__(self, colors: list[str], **kw) -> None:
        super().__init__(**kw)
        self.pane_colors = colors
        self.occupancy: deque[float] = deque([0.0] * HISTORY, maxlen=HISTORY)
        self.last: dict | None = None  # the newest event
        self.connected = False
        self.shown_model: str | None = None  # the model whose engine the bars show
        self.kv_cache = ""  # its KV cache's type, bytes per token and capacity (kv_cache_text of /health's facts)
        self.hit_blocks = 0  # prefix-cache hits seen since the panel opened
        self.disk_hit_blocks = 0  # of them, blocks read back from the disk prompt cache first
        self.reused_tokens = 0  # prompt positions taken from a recent prompt at shifted places (--cache-reuse)
        self.redraws = 0  # redraws that changed something, over the panel's life
        self._drawn: dict | None = None  # the event the lines show (each event a new one: a cluster's merged
        # events can change, a replica joining, while their step, the busiest replica's, does not)
        self._texts: dict[str, object] = {}  # what each Static shows now
        self._cells: tuple | None = None  # what the block map shows now
        self._map: Text | None = None  # a block map drawn at the next redraw

        # its parts, made once: the redraws use these, not DOM queries (cheap, and safe while shutting down)
        self.lines = {
            wid: Static(text, id=wid)
            for wid, text in (
                ("engine-mode", "[b]engine[/] connecting…"),
                ("engine-batch", ""),
                ("engine-kv", ""),
                ("engine-replicas", ""),  # behind minibatch-serve: a line per replica
                ("engine-models", ""),  # several models loaded: a line per model
                ("engine-numbers", ""),
                ("engine-map", ""),
            )
        }
        self.spark = Sparkline(list(self.occupancy), id="engine-spark", summary_function=max)
        self.lines["engine-replicas"].display = False
        self.lines["engine-models"].display = False
        self._timeline = Timeline(self.pane_colors, id="engine-timeline")

    def compose(self) -> ComposeResult:
        yield self.lines["engine-mode"]
        yield self.lines["engine-batch"]
        yield self.spark
        for wid in ("engine-kv", "engine-replicas", "engine-models", "engine-numbers", "engine-map"):
            yield self.lines[wid]
        yield self._timeline

    @property
    def drawn_step(self) -> int | None:
        """The step of the event the panel's lines show."""
        return self._drawn.get("step") if self._drawn is not None else None

    @property
    def timeline(self) -> Timeline:
        return self._timeline

    @property
    def showing_timeline(self) -> bool:
        return self.has_class("timeline")

    def toggle_timeline(self) -> bool:
        """Show the timeline in place of the block map (or back); returns whether it is shown now."""
        self.toggle_class("timeline")
        return self.showing_timeline

    def set_target(self, target: str) -> None:
        """The daemon's socket or URL, under the panel (its tail when it is long)."""
        self.border_title = "engine · " + (target if len(target) <= 20 else "…" + target[-19:]) if target else "engine"

    def set_disconnected(self, reason: str) -> None:
        self.connected, self._drawn = False, None
        self._show("engine-mode", f"[b]engine[/] [yellow]reconnecting…[/]\n[dim]{reason[:70]}[/]")

    def set_not_loaded(self, model: str) -> None:
        """The daemon answers, but the model the panel follows has no engine yet."""
        self.connected, self._drawn = False, None
        self._show("engine-mode", f"[b]engine[/] [dim]{model[:40]} loads with the first message[/]")

    def _show(self, wid: str, content) -> bool:
        """Update one Static if what it shows changed; lay out again only when its line count did."""
        old = self._texts.get(wid)
        if old == content:
            return False
        self._texts[wid] = content
        lines = str(content).count("\n")
        self.lines[wid].update(content, layout=old is None or str(old).count("\n") != lines)
        return True

    def update_stats(self, e: dict) -> None:
        """The newest step event; drawn at the next redraw (events in between only add their counts)."""
        self.connected, self.last = True, e
        self.hit_blocks += e.get("prefix_hit_blocks", 0)
        self.disk_hit_blocks += e.get("disk_hit_blocks", 0)
        self.reused_tokens += e.get("reused_tokens", 0)

    def redraw(self) -> None:
        """Draw the newest event: each line only if it changed, the sparkline one sample a redraw; and the
        block map if it moved since the last redraw."""
        if self._map is not None:
            self._show("engine-map", self._map)
            self._map = None
        e = self.last
        if e is None or not self.connected:
            return
        self.occupancy.append(e["running"])
        samples = list(self.occupancy)
        changed = samples != self.spark.data
        if changed:
            self.spark.data = samples
        if e is self._drawn:
            self.redraws += changed
            return
        self._drawn = e
        pending = f"\n[yellow]→ {e['pending_mode']} at the batch boundary[/]" if e.get("pending_mode") else ""
        changed |= self._show("engine-mode", f"[b]mode[/] [b reverse] {e['mode']} [/] [dim]ctrl+t[/]{pending}")
        running, cap = e["running"], e["max_num_seqs"]
        changed |= self._show(
            "engine-batch", f"batch {running:>2}/{cap:<3} {bar(running / cap if cap else 0, 14)} wait {e['waiting']}"
        )
        used, total = e["kv_blocks_used"], e["kv_blocks_total"]
        changed |= self._show(
            "engine-kv",
            f"KV    {bar(used / total if total else 0, 14)} {e.get('kv_usage_percent', 0):4.1f}%\n"
            f"      {used}/{total} blocks" + (f"\n      {self.kv_cache}" if self.kv_cache else ""),
        )
        self.lines["engine-replicas"].display = "replicas" in e
        if "replicas" in e:
            changed |= self._show("engine-replicas", replica_lines(e["replicas"]))
        several = len(e.get("models") or ()) > 1
        self.lines["engine-models"].display = several
        if several:
            changed |= self._show("engine-models", model_lines(e["models"], e.get("model")))
        lines = [
            f"prefill {e.get('prefill_tokens_per_s', 0):7.1f} tok/s",
            f"decode  {e.get('decode_tokens_per_s', 0):7.1f} tok/s",
            f"step {1000 * e['step_time']:5.0f} ms  preempted {e['total_preemptions']}",
            f"prefix-cache hits {self.hit_blocks} blocks"
            + (f", {self.disk_hit_blocks} disk" if self.disk_hit_blocks else "")
            + (f", {self.reused_tokens} tok shifted" if self.reused_tokens else ""),
        ]
        # rows that say something only at times are there (blank) all the time: a line that came and went
        # laid out the whole screen each time (the contention hint does, under load) and moved the map
        wasted = e["mode"] == "static" or e["wasted_row_steps"]
        lines.append(f"wasted row-steps {e['wasted_row_steps']}" if wasted else "")
        lines += [speculation_line(e) or "", contention_line(e.get("cpu_wait_share")) or ""]
        if "images_encoded" in e:  # a vision model: its tower's work beside the steps
            lines.append(image_line(e))
        changed |= self._show("engine-numbers", "\n".join(lines))
        self.redraws += changed

    def update_blocks(self, blocks: dict, owners: dict[str, int]) -> None:
        cells = block_map_cells(blocks, owners)
        per = max(1, -(-blocks.get("total", 0) // MAP_CELLS)) if blocks.get("total") else 1
        if (per, cells) == self._cells:  # nothing moved: no redraw
            return
        self._cells = (per, cells)
        text = Text("KV block map ", style="bold")
        text.append("(ctrl+g: timeline)\n", style="dim")
        text.append(f"■ = {per} block{'s' if per > 1 else ''}, by pane; ◆ shared; ▲ an embedding's\n", style="dim")
        letters = adapter_letters(adapter for *_, adapter in cells if adapter)
        if letters:  # a request under a LoRA adapter: its blocks show the adapter's letter, as in the timeline
            text.append("LoRA " + "  ".join(f"{c} {name}" for name, c in letters.items()) + "\n", style="dim")
        width = 32
        for i, (state, pane, shared, adapter) in enumerate(cells):
            if state == "free":
                text.append("·", style="grey37")
            else:
                color = self.pane_colors[pane % len(self.pane_colors)] if pane is not None else "grey70"
                mark = "◆" if shared else "▲" if state == "embedding" else letters.get(adapter or "", "■")
                text.append(mark, style=f"bold {color}" if mark in letters.values() else color)
            if (i + 1) % width == 0:
                text.append("\n")
        self._map = text  # drawn at the next redraw, in the frame clock's frame (not a screen update of its own)

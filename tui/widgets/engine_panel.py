"""The live view of the engine.

Mode, batch occupancy, KV cache, queue, rates, and a KV block map or the batch timeline.
"""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline, Static

from .timeline import Timeline

HISTORY = 120  # occupancy samples kept (about a minute at ~2 samples a second)
MAP_CELLS = 96  # cells in the block map; each stands for one block or a group of blocks


def bar(fraction: float, width: int) -> str:
    filled = max(0, min(width, round(fraction * width)))
    return "█" * filled + "░" * (width - filled)


def block_map_cells(blocks: dict, owners: dict[str, int], cells: int = MAP_CELLS) -> list[tuple[str, int | None, bool]]:
    """Per cell: ('free'|'cached'|'used', pane index owning most of it or None, holds a shared block)."""
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
    out = []
    for c in range(n_cells):
        ids = range(1 + c * per_cell, 1 + min(total, (c + 1) * per_cell))  # block 0 is the null block
        held = [owner_of[b] for b in ids if b in owner_of]
        if not held:
            out.append(("free", None, False))
            continue
        top = max(set(held), key=held.count)
        out.append(("used", owners.get(top), any(b in shared for b in ids)))
    return out


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


class EnginePanel(Vertical):
    """Updated from /v1/engine/events by the app."""

    def __init__(self, colors: list[str], **kw) -> None:
        super().__init__(**kw)
        self.pane_colors = colors
        self.occupancy: deque[float] = deque([0.0] * HISTORY, maxlen=HISTORY)
        self.last: dict | None = None
        self.connected = False
        self.hit_blocks = 0  # prefix-cache hits seen since the panel opened

    def compose(self) -> ComposeResult:
        yield Static("[b]engine[/] connecting…", id="engine-mode")
        yield Static("", id="engine-batch")
        yield Sparkline(list(self.occupancy), id="engine-spark", summary_function=max)
        yield Static("", id="engine-kv")
        replicas = Static("", id="engine-replicas")  # behind minibatch-serve: a line per replica
        replicas.display = False
        yield replicas
        yield Static("", id="engine-numbers")
        yield Static("", id="engine-map")
        yield Timeline(self.pane_colors, id="engine-timeline")

    @property
    def timeline(self) -> Timeline:
        return self.query_one(Timeline)

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
        self.connected = False
        self.query_one("#engine-mode", Static).update(f"[b]engine[/] [yellow]reconnecting…[/]\n[dim]{reason[:70]}[/]")

    def update_stats(self, e: dict) -> None:
        self.connected, self.last = True, e
        pending = f"\n[yellow]→ {e['pending_mode']} at the batch boundary[/]" if e.get("pending_mode") else ""
        self.query_one("#engine-mode", Static).update(f"[b]mode[/] [b reverse] {e['mode']} [/] [dim]ctrl+t[/]{pending}")
        running, cap = e["running"], e["max_num_seqs"]
        self.occupancy.append(running)
        spark = self.query_one("#engine-spark", Sparkline)
        spark.data = list(self.occupancy)
        self.query_one("#engine-batch", Static).update(
            f"batch {running:>2}/{cap:<3} {bar(running / cap if cap else 0, 14)} wait {e['waiting']}"
        )
        used, total = e["kv_blocks_used"], e["kv_blocks_total"]
        self.query_one("#engine-kv", Static).update(
            f"KV    {bar(used / total if total else 0, 14)} {e.get('kv_usage_percent', 0):4.1f}%\n"
            f"      {used}/{total} blocks"
        )
        replicas = self.query_one("#engine-replicas", Static)
        replicas.display = "replicas" in e
        if "replicas" in e:
            replicas.update(replica_lines(e["replicas"]))
        self.hit_blocks += e.get("prefix_hit_blocks", 0)
        lines = [
            f"prefill {e.get('prefill_tokens_per_s', 0):7.1f} tok/s",
            f"decode  {e.get('decode_tokens_per_s', 0):7.1f} tok/s",
            f"step {1000 * e['step_time']:5.0f} ms  preempted {e['total_preemptions']}",
            f"prefix-cache hits {self.hit_blocks} blocks",
        ]
        if e["mode"] == "static" or e["wasted_row_steps"]:
            lines.append(f"wasted row-steps {e['wasted_row_steps']}")
        self.query_one("#engine-numbers", Static).update("\n".join(lines))

    def update_blocks(self, blocks: dict, owners: dict[str, int]) -> None:
        target = next(self.query("#engine-map").results(Static), None)
        if target is None:  # a poll that returns while the app shuts down finds its children gone
            return
        cells = block_map_cells(blocks, owners)
        text = Text("KV block map ", style="bold")
        text.append("(ctrl+g: timeline)\n", style="dim")
        per = max(1, -(-blocks.get("total", 0) // MAP_CELLS)) if blocks.get("total") else 1
        text.append(f"■ = {per} block{'s' if per > 1 else ''}, by pane; ◆ shared\n", style="dim")
        width = 32
        for i, (state, pane, shared) in enumerate(cells):
            if state == "free":
                text.append("·", style="grey37")
            else:
                color = self.pane_colors[pane % len(self.pane_colors)] if pane is not None else "grey70"
                text.append("◆" if shared else "■", style=color)
            if (i + 1) % width == 0:
                text.append("\n")
        target.update(text)

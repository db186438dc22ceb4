"""How often the chat draws, and why at these rates.

The chat shares the machine with the engine it shows: on a laptop the daemon's threads and this
terminal app run on the same cores, and every frame the chat lays out and paints is CPU time the engine
does not get. So nothing here draws per token or per engine step. Streamed text waits in its pane for the
next frame, the panel draws only the newest step event, and a widget is redrawn only when what it shows
changed (a transcript repaints only its changed rows while its height stays).

- Frames: every pane appends what streamed in since the last frame, all panes in the same frame. The
  interval starts at FRAME_MIN_S (0.1 s: ten updates a second reads as text flowing, and at 20-60
  tokens/s a pane gets 2-6 tokens a frame) and follows the chat's own CPU use (`pace`): while the chat
  takes more than CPU_BUDGET of one core it draws less often, up to FRAME_MAX_S (0.5 s), and comes back
  when it takes less. A fast machine draws at ten frames a second; a slow one keeps its cores for the
  engine and shows text in larger steps.
- Streams: the chat asks the daemon for a chunk of a pane's answer at most every FRAME_MIN_S
  (stream_options.interval_ms): text it cannot draw sooner need not be received, parsed and handed to
  its pane token by token (a chunk per engine step was ~0.2 s of the chat's CPU per 1,000 tokens
  with six panes, and as much of the daemon's event loop).
- PANEL_S, 0.3 s: the panel's lines (mode, batch, KV, rates, contention) and its sparkline redraw at
  most about three times a second: numbers that change faster cannot be read anyway.
- STATUS_S, 1 s: a streaming pane's status line (its chunk count) changes once a second: six panes'
  counts every frame were six re-rendered lines of markup a frame, for a number that only says it moves.
- POLL_S, 0.5 s: the KV block map and the batch timeline fetch their data twice a second and redraw
  only when it changed; the block map in the panel's next redraw, not as a screen update of its own.
- Full garbage collections wait until no answer streams (or FULL_GC_MAX_S has passed): every cached line
  of every transcript is a Textual strip with its own small caches, so a full collection walks hundreds of
  thousands of objects, ~0.1 s, and while six panes streamed one came every few seconds. The young
  generations are collected as usual.
- While any answer streams the inputs' cursors hold still: a blinking one is two screen updates a second
  that show nothing new.
"""

FRAME_MIN_S = 0.1
FRAME_MAX_S = 0.5
CPU_BUDGET = 0.08  # share of one core the chat aims to stay under while it streams
PANEL_S = 0.3
STATUS_S = 1.0
POLL_S = 0.5
FULL_GC_MAX_S = 60.0
NO_FULL_GC = 10**9  # the oldest generation's threshold while the chat decides when to collect it


def pace(interval: float, cpu_share: float) -> float:
    """The next frame interval, from the current one and the share of a core the chat used since the last
    frame: longer while over the budget, shorter once well under it, within [FRAME_MIN_S, FRAME_MAX_S]."""
    if cpu_share > CPU_BUDGET:
        return min(FRAME_MAX_S, interval * 1.5)
    if cpu_share < CPU_BUDGET / 2:
        return max(FRAME_MIN_S, interval * 0.8)
    return interval

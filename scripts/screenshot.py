#!/usr/bin/env python3
"""The README's picture of the chat, taken from the real app against a real daemon: four panes answering one
broadcast at once beside the engine panel, its KV block map, and (with --timeline) the batch timeline.

    .venv/bin/python scripts/screenshot.py                      # a private daemon; writes docs/chat.svg
    .venv/bin/python scripts/screenshot.py --timeline --out docs/chat-timeline.svg
    .venv/bin/python scripts/screenshot.py --socket PATH        # a running daemon instead

The chat runs headless (Textual's test driver) at a fixed size with empty history; the picture is taken
when every pane has streamed --chunks pieces of its answer (or finished it), or at --seconds, whichever
comes first. The requests are seeded (the chat's sampling defaults, pane N with seed N), so the words are
the same run to run; the timings in the panel are this run's.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def start_private(model: str, folder: Path) -> str:
    sock = str(folder / "d.sock")
    cmd = [sys.executable, "-m", "minibatch.daemon.cli", "start", "--socket", sock, "--model", model]
    cmd += ["--log-file", str(folder / "d.log"), "--max-num-seqs", "8"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"screenshot: the daemon did not start:\n{proc.stdout}{proc.stderr}")
    return sock


def stop_private(sock: str) -> None:
    subprocess.run([sys.executable, "-m", "minibatch.daemon.cli", "stop", "--socket", sock], capture_output=True)


async def take(args, target: str) -> Path:
    from textual.widgets import Input

    from minibatch.tui.app import MinibatchChat
    from minibatch.tui.client import DaemonClient
    from minibatch.tui.frames import FRAME_MIN_S
    from minibatch.tui.history import History

    with tempfile.TemporaryDirectory(prefix="mb-shot-") as d:
        history = History(Path(d) / "chat.sqlite3")
        app = MinibatchChat(DaemonClient(target, None, stream_interval=FRAME_MIN_S), history)
        width, height = (int(v) for v in args.size.split("x"))
        try:
            async with app.run_test(size=(width, height)) as pilot:
                for _ in range(args.panes - 1):
                    await pilot.press("ctrl+n")
                    await pilot.pause()
                for inp in app.query(Input):
                    inp.cursor_blink = False  # a still picture
                for i, pane in enumerate(app.panes()):
                    pane.settings.seed = i + 1  # four different answers, the same ones every run
                await pilot.press(*args.prompt)
                await pilot.press("ctrl+b")
                if args.timeline:
                    await pilot.press("ctrl+g")
                deadline = time.monotonic() + args.seconds
                while time.monotonic() < deadline:
                    if all(p.chunks >= args.chunks or not p.busy for p in app.panes()):
                        break
                    await pilot.pause(0.2)
                await pilot.pause(0.5)  # a frame of the panel after the last check
                args.out.parent.mkdir(parents=True, exist_ok=True)
                app.save_screenshot(args.out.name, str(args.out.parent))
                for pane in app.panes():  # the answers stop here (the daemon aborts them), before the app closes
                    pane.cancel()
                while any(p.busy for p in app.panes()):
                    await pilot.pause(0.05)
        finally:
            history.close()
    return args.out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", default=None, help="a running daemon's socket (default: start a private one)")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="the private daemon's model")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "chat.svg", help="the SVG to write")
    ap.add_argument("--size", default="150x42", help="the terminal's columns x rows")
    ap.add_argument("--panes", type=int, default=4, help="chat panes (1-6)")
    ap.add_argument("--prompt", default=PROMPT, help="what every pane asks at once")
    ap.add_argument("--chunks", type=int, default=8, help="streamed pieces each answer has before the picture")
    ap.add_argument("--seconds", type=float, default=60, help="the picture at the latest after this long")
    ap.add_argument("--timeline", action="store_true", help="the batch timeline in place of the block map")
    args = ap.parse_args()
    if not 1 <= args.panes <= 6:
        ap.error("--panes: 1 to 6")
    folder = Path(tempfile.mkdtemp(prefix="mb-shot-", dir="/tmp"))
    sock = args.socket or start_private(args.model, folder)
    try:
        out = asyncio.run(take(args, sock))
    finally:
        if args.socket is None:
            stop_private(sock)
    print(f"screenshot: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

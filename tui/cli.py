"""`minibatch-chat`: open the chat on the daemon's socket (or a TCP URL), starting the daemon if asked."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import platformdirs

from minibatch.daemon.client import request_json
from minibatch.daemon.paths import default_socket

from .niceness import be_nice


def default_db() -> Path:
    env = os.environ.get("MINIBATCH_CHAT_DB")
    return Path(env) if env else Path(platformdirs.user_data_dir("minibatch")) / "chat.sqlite3"


def daemon_health(target: str, api_key: str | None = None) -> tuple[int | None, dict]:
    try:
        return request_json(target, "GET", "/health", timeout=3, api_key=api_key)
    except OSError:
        return None, {}


def start_daemon(socket: Path) -> bool:
    print(f"minibatch-chat: starting minibatchd on {socket} …", file=sys.stderr)
    proc = subprocess.run([sys.executable, "-m", "minibatch.daemon.cli", "start", "--socket", str(socket)])
    return proc.returncode == 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="minibatch-chat", description="Chat with several panes at once and watch the batch."
    )
    ap.add_argument(
        "--socket", type=Path, default=None, help=f"daemon socket (env MINIBATCH_SOCKET; default {default_socket()})"
    )
    ap.add_argument(
        "--url",
        default=os.environ.get("MINIBATCH_URL"),
        help="talk to a daemon's TCP listener instead, e.g. http://127.0.0.1:8000 (env MINIBATCH_URL)",
    )
    ap.add_argument(
        "--api-key",
        default=os.environ.get("MINIBATCH_API_KEY"),
        help="API key to send (env MINIBATCH_API_KEY; needed over TCP when the daemon has one)",
    )
    ap.add_argument(
        "--start", action="store_true", help="start the daemon (built-in model) if it is not running, without asking"
    )
    ap.add_argument(
        "--nice",
        type=int,
        default=int(os.environ.get("MINIBATCH_CHAT_NICE", "10")),
        help="scheduling niceness the chat runs at, so the engine it shows keeps the cores it needs; "
        "0 for none (env MINIBATCH_CHAT_NICE; default 10)",
    )
    ap.add_argument("--new", action="store_true", help="start with empty history")
    ap.add_argument(
        "--db", type=Path, default=None, help=f"chat history file (env MINIBATCH_CHAT_DB; default {default_db()})"
    )
    args = ap.parse_args(argv)
    socket = args.socket or default_socket()
    url = args.url.rstrip("/") if args.url else None
    if url and not url.startswith("http://"):
        print(
            "minibatch-chat: --url must start with http:// (for https, use a reverse proxy's plain side)",
            file=sys.stderr,
        )
        return 2
    target = url or str(socket)

    status, health = daemon_health(target, args.api_key)
    if status == 401:
        print(
            f"minibatch-chat: {target} needs an API key: --api-key or MINIBATCH_API_KEY "
            f"({health.get('error', {}).get('message', 'unauthorized')})",
            file=sys.stderr,
        )
        return 1
    if status is None and url:
        print(f"minibatch-chat: no daemon answers at {url}", file=sys.stderr)
        return 1
    if status is None:
        if not args.start:
            if not sys.stdin.isatty():
                print(
                    f"minibatch-chat: no daemon answers on {socket}; start one with `minibatchd start` "
                    "or run minibatch-chat --start",
                    file=sys.stderr,
                )
                return 1
            answer = input(f"No minibatchd is running on {socket}. Start one now? [Y/n] ").strip().lower()
            if answer not in ("", "y", "yes"):
                return 1
        if not start_daemon(socket):
            print("minibatch-chat: the daemon did not start; see `minibatchd logs`", file=sys.stderr)
            return 1
    elif status != 200:
        print(f"minibatch-chat: the daemon is {health.get('status', 'not ready')}; waiting…", file=sys.stderr)
        deadline = time.monotonic() + 600
        while daemon_health(target, args.api_key)[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.5)

    # The chat only draws; the daemon's threads do the work it shows. Being nicer than them, it takes an
    # idle core at once but never preempts an engine thread (the engine's steps wait for their slowest
    # thread, so one preempted thread stalls the whole step).
    restore_nice = be_nice(args.nice) if args.nice else lambda: None

    try:
        # textual-image asks the terminal what graphics it draws (sixel, kitty's) when it is imported: before
        # the app owns the terminal, or the terminal's answer arrives as keys typed into a pane
        import textual_image.widget  # noqa: F401

        from .app import MinibatchChat
        from .client import DaemonClient
        from .frames import FRAME_MIN_S
        from .history import History

        history = History(args.db or default_db())
        if args.new:
            history.reset()
        try:
            # the daemon sends a pane's text no more often than the chat can draw it
            MinibatchChat(DaemonClient(target, args.api_key, stream_interval=FRAME_MIN_S), history).run()
        finally:
            history.close()
    finally:
        restore_nice()
    return 0


if __name__ == "__main__":
    sys.exit(main())

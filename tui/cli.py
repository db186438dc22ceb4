"""`minibatch-chat`: open the chat on the daemon's socket, starting the daemon if asked."""

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


def default_db() -> Path:
    env = os.environ.get("MINIBATCH_CHAT_DB")
    return Path(env) if env else Path(platformdirs.user_data_dir("minibatch")) / "chat.sqlite3"


def daemon_health(socket: Path) -> tuple[int | None, dict]:
    try:
        return request_json(str(socket), "GET", "/health", timeout=3)
    except OSError:
        return None, {}


def start_daemon(socket: Path) -> bool:
    print(f"minibatch-chat: starting minibatchd on {socket} …", file=sys.stderr)
    proc = subprocess.run([sys.executable, "-m", "minibatch.daemon.cli", "start", "--socket", str(socket)])
    return proc.returncode == 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="minibatch-chat", description="Chat with several panes at once and watch the batch.")
    ap.add_argument("--socket", type=Path, default=None, help=f"daemon socket (env MINIBATCH_SOCKET; default {default_socket()})")
    ap.add_argument("--start", action="store_true", help="start the daemon (built-in model) if it is not running, without asking")
    ap.add_argument("--new", action="store_true", help="start with empty history")
    ap.add_argument("--db", type=Path, default=None, help=f"chat history file (env MINIBATCH_CHAT_DB; default {default_db()})")
    args = ap.parse_args(argv)
    socket = args.socket or default_socket()

    status, health = daemon_health(socket)
    if status is None:
        if not args.start:
            if not sys.stdin.isatty():
                print(f"minibatch-chat: no daemon answers on {socket}; start one with `minibatchd start` "
                      "or run minibatch-chat --start", file=sys.stderr)
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
        while daemon_health(socket)[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.5)

    from .app import MinibatchChat
    from .client import DaemonClient
    from .history import History

    history = History(args.db or default_db())
    if args.new:
        history.reset()
    try:
        MinibatchChat(DaemonClient(str(socket)), history).run()
    finally:
        history.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

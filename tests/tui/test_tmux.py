"""End to end in a real terminal: tmux runs minibatch-chat against the real daemon (tiny model)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest

from tests.daemon.helpers import Daemon

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def tmux(*args: str, check=True) -> str:
    # -f /dev/null: no user config (a changed prefix or size would change what the test sees)
    out = subprocess.run(["tmux", "-L", "mbtest", "-f", "/dev/null", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(out.stderr)
    return out.stdout


def screen() -> str:
    return tmux("capture-pane", "-p", "-t", "chat")


def wait_for(predicate, timeout=60.0, what="screen condition"):
    deadline = time.monotonic() + timeout
    seen = ""
    while time.monotonic() < deadline:
        seen = screen()
        if predicate(seen):
            return seen
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; screen:\n{seen}")


def test_two_panes_broadcast_in_a_real_terminal(tiny_chat_model_dir, short_tmp):
    sock = short_tmp / "d.sock"
    daemon = Daemon(sock, tiny_chat_model_dir, "--kv-cache-gb", "0.05").wait_ready()
    env = f"MINIBATCH_CHAT_DB={short_tmp / 'chat.db'}"
    cmd = f"env {env} {sys.executable} -m minibatch.tui.cli --socket {sock} --new"
    tmux("kill-server", check=False)
    try:
        tmux("new-session", "-d", "-s", "chat", "-x", "130", "-y", "40", cmd)
        tmux("resize-window", "-t", "chat", "-x", "130", "-y", "40", check=False)
        wait_for(lambda s: "mode" in s and "continuous" in s, what="the engine panel")
        tmux("send-keys", "-t", "chat", "C-n")
        wait_for(lambda s: s.count("pane 2") >= 1, what="a second pane")
        tmux("send-keys", "-t", "chat", "-l", "hello there")
        wait_for(lambda s: "hello there" in s, what="the typed text")  # the app has taken the keys in
        tmux("send-keys", "-t", "chat", "C-b")
        tmux("send-keys", "-t", "chat", "C-g")  # the timeline in place of the block map while both panes answer
        saw_two = saw_rows = False
        deadline = time.monotonic() + 90
        final = ""
        while time.monotonic() < deadline:
            final = screen()
            if "batch  2/32" in final:
                saw_two = True
            if "batch timeline" in final:
                below = final.split("batch timeline")[1].splitlines()
                busy = [line for line in below if ("  0  " in line or "  1  " in line) and ("█" in line or "▒" in line)]
                saw_rows = saw_rows or len(busy) >= 2
            if final.count("TTFT") >= 2:
                break
            time.sleep(0.05)
        assert final.count("TTFT") >= 2, final  # both panes finished an answer
        assert saw_two, final  # the panel showed both requests in the batch at once
        assert saw_rows, final  # the timeline showed both rows busy
        assert "Traceback" not in final and "KV block map" not in final
        tmux("send-keys", "-t", "chat", "C-g")
        back = wait_for(lambda s: "batch timeline" not in s, what="the timeline hidden again")
        assert "Traceback" not in back
    finally:
        tmux("kill-server", check=False)
        daemon.stop()

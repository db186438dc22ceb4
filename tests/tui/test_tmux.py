"""End to end in a real terminal: tmux runs minibatch-chat against the real daemon (tiny model)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

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


def open_chat(sock: Path, db: Path, width: int = 130, height: int = 40) -> None:
    """minibatch-chat on the daemon at `sock`, a fresh history in `db`, in a tmux window of that size, once
    its engine panel shows."""
    cmd = f"env MINIBATCH_CHAT_DB={db} {sys.executable} -m minibatch.tui.cli --socket {sock} --new"
    tmux("kill-server", check=False)
    size = ("-x", str(width), "-y", str(height))
    tmux("new-session", "-d", "-s", "chat", *size, cmd)
    tmux("resize-window", "-t", "chat", *size, check=False)
    wait_for(lambda s: "mode" in s and "continuous" in s, what="the engine panel")


def test_two_panes_broadcast_in_a_real_terminal(tiny_chat_model_dir, short_tmp):
    sock = short_tmp / "d.sock"
    daemon = Daemon(sock, tiny_chat_model_dir, "--kv-cache-gb", "0.05").wait_ready()
    try:
        open_chat(sock, short_tmp / "chat.db")
        if Path("/proc/self/autogroup").exists():  # its terminal session yields to the daemon's (niceness.py)
            pid = tmux("list-panes", "-t", "chat", "-F", "#{pane_pid}").split()[0]
            assert Path(f"/proc/{pid}/autogroup").read_text().split()[-1] == "10"
        tmux("send-keys", "-t", "chat", "C-n")
        wait_for(lambda s: s.count("pane 2") >= 1, what="a second pane")
        tmux("send-keys", "-t", "chat", "-l", "hello there")
        wait_for(lambda s: "hello there" in s, what="the typed text")  # the app has taken the keys in
        tmux("send-keys", "-t", "chat", "C-b")
        tmux("send-keys", "-t", "chat", "C-g")  # the timeline in place of the block map while both panes answer

        def two_rows_busy(s: str) -> bool:
            if "batch timeline" not in s:
                return False
            below = s.split("batch timeline")[1].splitlines()
            busy = [line for line in below if ("  0  " in line or "  1  " in line) and ("█" in line or "▒" in line)]
            return len(busy) >= 2

        saw_two = saw_rows = False
        deadline = time.monotonic() + 90
        final = ""
        while time.monotonic() < deadline:
            final = screen()
            if "batch  2/32" in final:
                saw_two = True
            saw_rows = saw_rows or two_rows_busy(final)
            if final.count("TTFT") >= 2:
                break
            time.sleep(0.05)
        assert final.count("TTFT") >= 2, final  # both panes finished an answer
        assert saw_two, final  # the panel showed both requests in the batch at once
        if not saw_rows:  # the answers can end before the timeline's next poll: the steps they took stay drawn
            final = wait_for(two_rows_busy, timeout=30, what="the timeline's rows of both answers")
        assert "Traceback" not in final and "KV block map" not in final
        tmux("send-keys", "-t", "chat", "C-g")
        back = wait_for(lambda s: "batch timeline" not in s, what="the timeline hidden again")
        assert "Traceback" not in back
    finally:
        tmux("kill-server", check=False)
        daemon.stop()


def test_two_panes_on_two_models_broadcast_at_once(tiny_chat_model_dir, short_tmp):
    """The second pane picks the built-in model (ctrl+o); a broadcast then runs both engines at once and the
    panel shows both models' lines."""
    sock = short_tmp / "d.sock"
    daemon = Daemon(sock, tiny_chat_model_dir, "--kv-cache-gb", "0.05").wait_ready()
    try:
        open_chat(sock, short_tmp / "chat.db", 140, 44)
        tmux("send-keys", "-t", "chat", "C-n")
        wait_for(lambda s: "pane 2" in s, what="a second pane")
        tmux("send-keys", "-t", "chat", "C-o")
        wait_for(lambda s: "smollm2-135m-instruct" in s and "loads on first use" in s, what="the model picker")
        tmux("send-keys", "-t", "chat", "Down", "Down", "Enter")  # the daemon's own, the loaded one, the built-in
        wait_for(lambda s: "pane 2  smollm2-135m-instruct" in s, what="pane 2 on the built-in model")
        tmux("send-keys", "-t", "chat", "-l", "hello there")
        wait_for(lambda s: "hello there" in s, what="the typed text")
        tmux("send-keys", "-t", "chat", "C-b")
        saw_both, final = False, ""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            final = screen()
            saw_both = saw_both or ("2 models" in final and "smollm2-135m-in" in final)
            # both answered, and the panel has shown both engines: both stay loaded, so its first poll after the
            # second model's load lists them, however soon the answers ended
            if final.count("TTFT") >= 2 and saw_both:
                break
            time.sleep(0.05)
        assert final.count("TTFT") >= 2, final  # both panes answered, each from its model
        assert saw_both, final  # the panel listed both engines
        assert "Traceback" not in final
        _, health = daemon.get("/health")
        assert {m["name"] for m in health["models"]} == {tiny_chat_model_dir.name, "smollm2-135m-instruct"}
    finally:
        tmux("kill-server", check=False)
        daemon.stop()


def test_a_pane_sends_a_picture_to_a_vision_model(tiny_vision_model_dir, short_tmp):
    """A file's path pasted at the start of the input (as a terminal pastes a dropped file) goes with the
    message to the real daemon serving a vision model, and the answer streams (the thumbnail's drawing is
    test_app.py's: here the answer scrolls it out of the short pane)."""
    from tests.vision_model import photo

    photo(7).save(short_tmp / "whiteboard.png")
    sock = short_tmp / "d.sock"
    # (a short context: the answer ends soon)
    daemon = Daemon(sock, tiny_vision_model_dir, "--kv-cache-gb", "0.05", "--max-model-len", "96").wait_ready()
    try:
        open_chat(sock, short_tmp / "chat.db")
        tmux("send-keys", "-t", "chat", "-l", f"'{short_tmp / 'whiteboard.png'}' what is drawn here?")
        wait_for(lambda s: "what is drawn here?" in s, what="the pasted path and question")
        tmux("send-keys", "-t", "chat", "Enter")
        final = wait_for(lambda s: "TTFT" in s, timeout=90, what="the answer's numbers")
        assert "error" not in final and "Traceback" not in final, final
        assert "[?" not in final, final  # (no terminal's answer to a query typed into the input)
        status, stats = daemon.get("/v1/engine/stats")
        assert stats["requests_finished"] >= 1
        import sqlite3

        with sqlite3.connect(short_tmp / "chat.db") as db:  # the turn kept with its picture
            rows = db.execute("SELECT content, images FROM messages WHERE role = 'user'").fetchall()
        assert rows == [("what is drawn here?", str(short_tmp / "whiteboard.png"))]
    finally:
        tmux("kill-server", check=False)
        daemon.stop()

"""Servers the benchmark compares minibatchd with, one module each, behind one small interface.

A peer is prepared once (find its binary, make its model files), then started
for each concurrency point with the model it serves, waited on until ready,
measured with the same trace as minibatchd, and stopped by pid. Only one server
runs at a time: two loaded at once would share the two cores.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import platformdirs


def peers_cache() -> Path:
    """Where prepared peer model files live (user cache dir)."""
    return Path(os.environ.get("MINIBATCH_PEERS_DIR") or Path(platformdirs.user_cache_dir("minibatch")) / "peers")


@dataclass(slots=True)
class Launch:
    """One server ready to start: its command line, where it answers, and what it is."""

    name: str  # e.g. "llama.cpp Q4_1" or "minibatch native"
    argv: list[str]
    url: str | None = None  # http://127.0.0.1:PORT for TCP servers
    socket: str | None = None  # a Unix socket (minibatchd)
    env: dict[str, str] = field(default_factory=dict)
    info: dict = field(default_factory=dict)  # version, commit, model file, threads ...
    stop_argv: list[str] | None = None  # a command that stops it (else SIGTERM to the pid)
    model: str | None = None  # the "model" field its API wants, if any


class Running:
    """A started server: its process (for RSS and stopping) and its log."""

    def __init__(self, launch: Launch, log_path: Path) -> None:
        self.launch = launch
        self.log_path = log_path
        log = log_path.open("wb")
        self.proc = subprocess.Popen(
            launch.argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **launch.env}, start_new_session=True
        )
        log.close()
        self.pid = self.proc.pid

    def stop(self, timeout: float = 60.0) -> None:
        if self.launch.stop_argv:
            subprocess.run(self.launch.stop_argv, capture_output=True, timeout=timeout)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def server_pid(running: Running) -> int:
    """The serving process: minibatchd start daemonizes, so its pid comes from its lock file."""
    if running.launch.socket:
        from minibatch.daemon.lifecycle import running_pid

        for _ in range(50):
            pid = running_pid(Path(running.launch.socket))
            if pid:
                return pid
            time.sleep(0.1)
    return running.pid

"""minibatchd itself, started on a private socket of its own with one weight mode."""

from __future__ import annotations

import sys
from pathlib import Path

from . import Launch


def command(socket: str, weights: str, concurrency: int, threads: int, model: str) -> list[str]:
    daemon = str(Path(sys.executable).parent / "minibatchd")
    return [daemon, "start", "--socket", socket, "--model", model, "--weights", weights, "--threads", str(threads),
            "--max-num-seqs", str(max(1, concurrency)), "--max-queue", "4096", "--no-prefix-caching"]


def launch(socket: str, weights: str, concurrency: int, threads: int, model: str) -> Launch:
    daemon = str(Path(sys.executable).parent / "minibatchd")
    return Launch(name=f"minibatch {weights}", argv=command(socket, weights, concurrency, threads, model), socket=socket,
                  stop_argv=[daemon, "stop", "--socket", socket], info={"weights": weights, "threads": threads})

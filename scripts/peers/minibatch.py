"""minibatchd itself, started on a private socket of its own with one weight mode."""

from __future__ import annotations

import sys
from pathlib import Path

from . import Launch


def command(
    socket: str, weights: str, concurrency: int, threads: int, model: str, kv_tokens: int | None = None
) -> list[str]:
    """minibatchd for `concurrency` requests; with kv_tokens, a KV pool of that many token slots
    (the same number llama.cpp gets: -c = slots x context per slot)."""
    daemon = str(Path(sys.executable).parent / "minibatchd")
    argv = [
        daemon,
        "start",
        "--socket",
        socket,
        "--model",
        model,
        "--weights",
        weights,
        "--threads",
        str(threads),
        "--max-num-seqs",
        str(max(1, concurrency)),
        "--max-queue",
        "4096",
        "--no-prefix-caching",
    ]
    if kv_tokens:
        argv += ["--kv-cache-tokens", str(kv_tokens)]
    return argv


def launch(
    socket: str, weights: str, concurrency: int, threads: int, model: str, kv_tokens: int | None = None
) -> Launch:
    daemon = str(Path(sys.executable).parent / "minibatchd")
    return Launch(
        name=f"minibatch {weights}",
        argv=command(socket, weights, concurrency, threads, model, kv_tokens),
        socket=socket,
        stop_argv=[daemon, "stop", "--socket", socket],
        info={"weights": weights, "threads": threads},
    )

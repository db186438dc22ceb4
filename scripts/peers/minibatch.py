"""minibatchd itself, started on a private socket of its own with one weight mode."""

from __future__ import annotations

import sys
from pathlib import Path

from . import Launch


# fp32 K and V of one token in every layer of the built-in model: 30 layers x 2 x 3 heads x 64 x 4 bytes.
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4


def command(socket: str, weights: str, concurrency: int, threads: int, model: str, kv_tokens: int | None = None) -> list[str]:
    """minibatchd for `concurrency` requests; with kv_tokens, a KV pool of that many token slots
    (the same number llama.cpp gets: -c = slots x context per slot)."""
    daemon = str(Path(sys.executable).parent / "minibatchd")
    argv = [daemon, "start", "--socket", socket, "--model", model, "--weights", weights, "--threads", str(threads),
            "--max-num-seqs", str(max(1, concurrency)), "--max-queue", "4096", "--no-prefix-caching"]
    if kv_tokens:
        argv += ["--kv-cache-gb", f"{kv_tokens * KV_BYTES_PER_TOKEN / 2**30:.4f}"]
    return argv


def launch(socket: str, weights: str, concurrency: int, threads: int, model: str, kv_tokens: int | None = None) -> Launch:
    daemon = str(Path(sys.executable).parent / "minibatchd")
    return Launch(name=f"minibatch {weights}", argv=command(socket, weights, concurrency, threads, model, kv_tokens),
                  socket=socket,
                  stop_argv=[daemon, "stop", "--socket", socket], info={"weights": weights, "threads": threads})

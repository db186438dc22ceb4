"""A tiny-model daemon shared by the fast checks, and helpers to assert it is clean afterwards."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from tests.daemon.helpers import Daemon

MAX_SEQS, MAX_QUEUE = 4, 8


@pytest.fixture(scope="module")
def tiny_daemon(tiny_chat_model_dir):
    d = tempfile.mkdtemp(prefix="mbr-", dir="/tmp")
    daemon = Daemon(
        Path(d) / "d.sock",
        tiny_chat_model_dir,
        "--max-num-seqs",
        str(MAX_SEQS),
        "--max-queue",
        str(MAX_QUEUE),
        "--kv-cache-gb",
        "0.05",
        "--read-timeout",
        "2",
    ).wait_ready()
    daemon.baseline = daemon.stats()["kv_blocks_used"]
    yield daemon
    assert daemon.stop() == 0, daemon.log_text()
    shutil.rmtree(d, ignore_errors=True)


def assert_clean(daemon, pid: int | None = None, timeout: float = 30.0) -> dict:
    """Same pid, /health OK, nothing running or waiting, KV back to the idle baseline."""
    stats = daemon.wait_idle(timeout)
    status, health = daemon.get("/health")
    assert status == 200 and health["status"] == "ok", health
    assert health["pid"] == (pid or daemon.pid)
    assert stats["kv_blocks_used"] == getattr(daemon, "baseline", 0)
    return stats

"""Where the daemon keeps its socket, lock, and log. Every path can be overridden."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP = "minibatch"


def runtime_dir() -> Path:
    """$MINIBATCH_RUNTIME_DIR, else $XDG_RUNTIME_DIR/minibatch, else /tmp/minibatch-<uid>."""
    env = os.environ.get("MINIBATCH_RUNTIME_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / APP
    # platformdirs would warn and pick a shared temp dir; a per-user one is safer.
    return Path("/tmp") / f"{APP}-{os.getuid()}"


def default_socket() -> Path:
    return Path(os.environ.get("MINIBATCH_SOCKET") or runtime_dir() / "minibatchd.sock")


def lock_path(socket: Path) -> Path:
    return socket.with_name(socket.name + ".lock")


def default_log_file() -> Path:
    env = os.environ.get("MINIBATCH_LOG_FILE")
    return Path(env) if env else Path(platformdirs.user_state_dir(APP)) / "minibatchd.log"


def default_cluster_socket() -> Path:
    """minibatch-serve's ingress: beside the daemon's socket, so both can run."""
    return Path(os.environ.get("MINIBATCH_SERVE_SOCKET") or runtime_dir() / "minibatch-serve.sock")


def default_cluster_log_file() -> Path:
    env = os.environ.get("MINIBATCH_SERVE_LOG_FILE")
    return Path(env) if env else Path(platformdirs.user_state_dir(APP)) / "minibatch-serve.log"

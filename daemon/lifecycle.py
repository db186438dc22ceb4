"""Single-instance lock, socket safety and pid bookkeeping for minibatchd.

The lock file (beside the socket) is flocked for the daemon's whole life and
holds its pid. Only the lock holder may touch the socket path: aiohttp would
silently unlink and take over a live daemon's socket, so the lock — not the
socket file — is what guarantees one daemon per path.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from contextlib import contextmanager
from pathlib import Path

from .paths import lock_path


class LifecycleError(RuntimeError):
    """The daemon cannot start here; the message says why."""


def ensure_private_dir(path: Path) -> None:
    """Create the socket's directory 0700, or refuse one that others can write to."""
    if not path.exists():
        old = os.umask(0o077)
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        finally:
            os.umask(old)
    st = path.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise LifecycleError(f"{path} is not a directory")
    if st.st_uid != os.getuid():
        raise LifecycleError(f"socket directory {path} is owned by uid {st.st_uid}, not by you ({os.getuid()})")
    if st.st_mode & 0o022:
        raise LifecycleError(
            f"socket directory {path} is group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o}); "
            "others could replace the socket. Use a private directory (chmod 700) or another --socket path"
        )


def read_pid(socket: Path) -> int | None:
    try:
        text = lock_path(socket).read_text().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def running_pid(socket: Path) -> int | None:
    """The pid of the daemon holding this socket's lock, or None when no daemon holds it."""
    path = lock_path(socket)
    if not path.exists():
        return None
    with path.open("a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return read_pid(socket) or -1
            raise
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


class InstanceLock:
    """Holds the flock for the daemon's lifetime; refuses when another daemon has it."""

    def __init__(self, socket: Path, prog: str = "minibatchd") -> None:
        self.socket = socket
        self.prog = prog  # the command that holds it, for the refusal
        self.path = lock_path(socket)
        self._file = None

    def acquire(self) -> None:
        ensure_private_dir(self.socket.parent)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        f = os.fdopen(fd, "r+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            pid = read_pid(self.socket)
            raise LifecycleError(
                f"{self.prog} is already running (pid {pid if pid else 'unknown'}) on {self.socket}; "
                f"stop it with `{self.prog} stop` or choose another --socket"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._file = f
        # We hold the lock, so a socket file here is a crashed daemon's leftover.
        if self.socket.exists() or self.socket.is_symlink():
            self.socket.unlink()

    def release(self) -> None:
        if self._file is None:
            return
        for p in (self.socket, self.path):
            try:
                p.unlink()
            except FileNotFoundError:
                pass
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()
        self._file = None


@contextmanager
def private_umask():
    """Sockets created inside get mode 0600."""
    old = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(old)

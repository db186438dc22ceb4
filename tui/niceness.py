"""The chat yields the CPU to the daemon it shows: its own niceness and its terminal session's.

`os.nice` alone does not reach the daemon. With Linux's autogroups (/proc/sys/kernel/sched_autogroup_enabled,
on by default in most distributions) the CPU is shared between sessions first and by niceness only within
one, and the daemon runs in a session of its own (`minibatchd start` detaches) while the chat runs in its
terminal's: a chat at nice 10 beside the daemon got the same share as at nice 0 (measured: a busy loop at
nice 19 in another session than a second one took half of their core, at nice 19 in the same session
almost none). So the session's autogroup is niced as well, for as long as the chat runs: it also holds
the terminal's shell, idle while the chat runs in the foreground, and the value it had is written back
when the chat exits (raising a nice value back to 0 needs no privilege).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

AUTOGROUP = Path("/proc/self/autogroup")  # "/autogroup-25 nice 0"; absent without autogroups


def be_nice(nice: int, autogroup: Path = AUTOGROUP) -> Callable[[], None]:
    """Run at `nice` (process and session); returns what puts the session's value back."""
    os.nice(nice)
    try:
        before = int(autogroup.read_text().split()[-1])
        if before >= nice:
            return lambda: None
        autogroup.write_text(str(nice))
    except (OSError, ValueError, IndexError):  # no autogroups here (or a kernel that refuses): nice alone
        return lambda: None

    def restore() -> None:
        try:
            autogroup.write_text(str(before))
        except OSError:
            pass

    return restore

"""How long the engine's threads waited for a core: the contention figure the chat's panel shows.

Linux counts, for every thread, the time it was ready to run but waited on a run queue for a CPU (the
second field of /proc/<pid>/task/<tid>/schedstat, in nanoseconds). Summed over the engine's threads
across a step and set against the step's wall time, it says how much of the step was lost to other
work on the machine: about zero on an idle machine, whatever the engine's own threads do (they never
outnumber the cores), and large while something else holds the cores — a browser, a build, the chat.
A slow step with no wait is the engine's own doing; a slow step with a large wait is the machine's.
Where there is no schedstat (other systems, or kernels without it) the figure is None.
"""

from __future__ import annotations

import os
import threading

TASKS = "/proc/self/task"
RESCAN_STEPS = 256  # the thread list is read again this often (pool threads appear after the first steps)


class RunQueueWait:
    """Seconds the process's threads have waited for a core, summed, read on the engine thread.

    The process's main thread is left out when the engine runs on another thread: in the daemon it is
    the event loop's, and waiting behind the engine's own threads is not contention from elsewhere."""

    def __init__(self) -> None:
        self._engine_tid: int | None = None
        self.tids: list[int] = []  # the threads read
        self._fds: list[int] = []  # their schedstat files, kept open: a step reads them, it does not open them
        self._reads = 0
        self.available = os.path.exists(f"{TASKS}/{os.getpid()}/schedstat")

    def seconds(self) -> float | None:
        if not self.available:
            return None
        if self._reads % RESCAN_STEPS == 0 or self._engine_tid != threading.get_native_id():
            self._scan()
        self._reads += 1
        total = 0
        for fd in self._fds:
            try:
                total += int(os.pread(fd, 64, 0).split()[1])
            except (OSError, IndexError, ValueError):  # a thread that ended since the scan
                continue
        return total / 1e9

    def _scan(self) -> None:
        self.close()
        self._engine_tid = threading.get_native_id()
        main = os.getpid()
        try:
            tids = [int(t) for t in os.listdir(TASKS)]
        except OSError:
            self.available = False
            return
        for t in tids:
            if t != main or t == self._engine_tid:
                try:
                    self._fds.append(os.open(f"{TASKS}/{t}/schedstat", os.O_RDONLY))
                except OSError:  # ended meanwhile
                    continue
                self.tids.append(t)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds, self.tids = [], []

    def __del__(self) -> None:
        self.close()

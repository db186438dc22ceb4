"""What the ingress reads of its routers: the routers of this process and the decisions they made.

Serve ships the router class to each process that holds a handle by value (a
copy of router.py's code), so state shared with the ingress lives here, in a
module the copy imports by name.
"""

from __future__ import annotations

import threading
from collections import Counter

DECISION_NAMES = ("hit", "hash", "spill", "least_loaded", "pinned")
_lock = threading.Lock()
_decisions: Counter = Counter()  # decision -> requests routed so, in this process
_routers: list = []  # the routers of this process (one per handle), newest last


def register(router) -> None:
    with _lock:
        _routers.append(router)


def count(decision: str) -> None:
    with _lock:
        _decisions[decision] += 1


def decisions() -> dict[str, int]:
    with _lock:
        return {name: _decisions.get(name, 0) for name in DECISION_NAMES}


def live_replicas() -> list[str] | None:
    """The replica ids the newest router of this process routes to, or None before one exists."""
    with _lock:
        router = _routers[-1] if _routers else None
    return router.replica_ids() if router is not None else None

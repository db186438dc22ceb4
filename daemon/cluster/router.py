"""The prefix-aware request router, inside Ray Serve's own routing hook (`ray.serve.request_router`).

Serve builds one router per deployment handle, in the process that holds the
handle: here the ingress. For each request it is asked which replicas to try,
best first; Serve then sends the request to the least loaded replica of the
first rank that has room (its own queue-length probes and cache), and keeps
requests it cannot place queued at the handle. The policy, after SGLang's
cache-aware router and the prefix-affinity router `ray.serve.llm` ships:

1. A request carries its prompt's block hashes (`prefix=`, from prefix.py).
   The replica last sent the longest start of them is preferred: a
   conversation's next turn, or a prompt with a known system prompt, goes
   where those KV blocks are cached ("hit").
2. A start never seen goes to the replica its first block hashes to, by
   rendezvous hashing over the live replicas ("hash"): requests sharing a
   first block agree on a replica without shared state, and a replica that
   joins or leaves moves only the keys that were, or become, its own.
3. When the preferred replica has more than `spill_threshold` requests in
   flight beyond the least loaded one, or no room, the request spills over to
   the least loaded replica ("spill"), and that replica becomes the prefix's.
4. Requests without a prompt (`prefix=None`) go to the least loaded replica;
   `replica=ID` pins a request to one replica (`?replica=`, per-replica views).

Decisions are counted when Serve reports a request routed (routing.py, read
by the ingress for /metrics). Serve ships this module to the handle's process
by value, so it keeps no state of its own at module level.
"""

from __future__ import annotations

from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from . import routing
from .prefix import PrefixTable, rendezvous


class PrefixRouter(RequestRouter):
    def initialize_state(self, spill_threshold: int = 8, table_capacity: int = 200_000) -> None:
        self.spill_threshold = spill_threshold
        self.table = PrefixTable(table_capacity)
        # request -> (decision, preferred replica, hashes) until Serve reports it routed; bounded, as a request
        # cancelled while queued at the handle is never reported
        self._choice: OrderedDict[str, tuple[str, str | None, list[int] | None]] = OrderedDict()
        routing.register(self)

    def replica_ids(self) -> list[str]:
        """The replicas Serve routes to now (running and healthy), by unique id; callable from any thread."""
        return sorted(r.unique_id for r in list(self._replicas))

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[str, int]:
        """Requests in flight per replica: Serve's cache where it is fresh, a probe where not."""
        lens, missing = {}, []
        for r in replicas:
            n = self._replica_queue_len_cache.get(r.replica_id)
            if n is None:
                missing.append(r)
            else:
                lens[r.replica_id.unique_id] = n
        if missing:
            for r, n in await self._probe_queue_lens(missing, 0):
                if n is not None:
                    lens[r.replica_id.unique_id] = n
        return lens

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if not by_id:
            return []
        kwargs = pending_request.kwargs if pending_request is not None else {}
        key = pending_request.metadata.internal_request_id if pending_request is not None else None
        pin = kwargs.get("replica")
        if pin is not None:
            self._remember(key, "pinned", pin, None)
            return [[by_id[pin]]] if pin in by_id else []
        hashes = kwargs.get("prefix")
        if not hashes:
            self._remember(key, "least_loaded", None, None)
            return [list(by_id.values())]
        owner, _ = self.table.longest_match(hashes, set(by_id))
        decision = "hit" if owner is not None else "hash"
        preferred = owner or rendezvous(hashes[0], sorted(by_id))
        lens = await self._queue_lens(list(by_id.values()))
        others = sorted((r for r in by_id if r != preferred), key=lambda r: lens.get(r, 0))
        if (
            others
            and preferred in lens
            and lens[preferred] - min(lens.get(r, 0) for r in others) > self.spill_threshold
        ):
            decision, ranks = "spill", [[by_id[others[0]]], [by_id[r] for r in others[1:]] + [by_id[preferred]]]
        else:
            ranks = [[by_id[preferred]], [by_id[r] for r in others]]
        self._remember(key, decision, preferred, hashes)
        return [rank for rank in ranks if rank]

    def _remember(self, key: str | None, decision: str, preferred: str | None, hashes: list[int] | None) -> None:
        if key is not None:
            self._choice[key] = (decision, preferred, hashes)
            while len(self._choice) > 10_000:
                self._choice.popitem(last=False)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        decision, preferred, hashes = self._choice.pop(
            pending_request.metadata.internal_request_id, ("least_loaded", None, None)
        )
        chosen = replica_id.unique_id
        if decision in ("hit", "hash") and chosen != preferred:
            decision = "spill"  # the preferred replica had no room
        routing.count(decision)
        if hashes:
            self.table.record(hashes, chosen)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id.unique_id)

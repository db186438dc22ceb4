"""The ingress's side of Ray Serve: the deployment handle, the calls through it, who is live, the counts.

`ReplicaSet.open` sends one request to a replica (chosen by the router from its
prompt's hashes, or pinned with `replica=`) and returns its status, headers and
body pieces; `views` asks every live replica at once (Serve's broadcast);
`watch` notices replicas that join or leave.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError

from minibatch.daemon.protocol import ApiError

from . import routing

log = logging.getLogger("minibatch.cluster")
ATTEMPTS = 3  # routings of a request that never reached a replica
VIEW_TIMEOUT = 10.0  # seconds for every replica's view to arrive


class ReplicaLost(Exception):
    def __init__(self, replica: str, cause: BaseException) -> None:
        super().__init__(f"replica {replica} was lost while serving the request ({type(cause).__name__})")
        self.replica = replica


class ReplicaSet:
    """The replicas as the ingress sees them through Serve's handle."""

    def __init__(self, model_name: str, routing: str, wanted: str, body_timeout: float = 30.0) -> None:
        self.handle = self.stream_handle = None  # Serve's, once the replicas are deployed (attach)
        self.model_name = model_name
        self.routing = routing  # "prefix" or "least-loaded"
        self.wanted = wanted  # "2" or "1:4"
        self.body_timeout = body_timeout  # seconds to receive a request body
        self.status = "loading"  # loading | ready | draining | failed
        self.load_error: str | None = None
        self.started_at = time.time()
        self.in_flight = 0
        self.mode: str | None = None  # the mode last switched to at the ingress: replicas that join get it
        self.known: set[str] = set()  # the replicas seen so far (watch)
        self.lost: dict[str, float] = {}  # replica -> when a request saw it die
        r = self.registry = CollectorRegistry()
        self.c_lost = Counter("minibatch_cluster_replica_lost", "Requests ended because their replica died", registry=r)
        self.c_retried = Counter(
            "minibatch_cluster_rerouted", "Requests routed again because they never reached a replica", registry=r
        )
        self.g_replicas = Gauge("minibatch_cluster_replicas", "Replicas Serve routes to", registry=r)
        self.g_inflight = Gauge("minibatch_cluster_in_flight_requests", "Requests the ingress is serving", registry=r)
        self.c_routes = Counter(
            "minibatch_cluster_route_decisions",
            "Routing decisions: prefix hit, consistent hash, spill-over, least loaded, pinned",
            ["decision"],
            registry=r,
        )
        self._routes_seen: dict[str, int] = {}

    def attach(self, handle) -> None:
        self.handle, self.stream_handle = handle, handle.options(stream=True)

    # -- calls ------------------------------------------------------------
    async def open(self, method: str, path: str, headers: dict, body: bytes, prefix=None, replica=None):
        """(replica, pid, status, headers, the body's chunk iterator) of a request sent through Serve."""
        for attempt in range(ATTEMPTS):
            gen = self.stream_handle.call.remote(method, path, headers, body, prefix=prefix, replica=replica)
            try:
                _, rid, pid = await gen.__anext__()
            except BackPressureError:
                raise ApiError(
                    429, "every replica's queue is full", None, "queue_full", "rate_limit_error", {"Retry-After": "1"}
                ) from None
            except RayError as exc:
                if attempt + 1 == ATTEMPTS:
                    raise ApiError(
                        503, f"no replica could take the request: {exc}", None, "no_replica", "unavailable"
                    ) from None
                self.c_retried.inc()
                continue
            try:
                _, status, kept = await gen.__anext__()
            except (RayError, StopAsyncIteration) as exc:
                self.mark_lost(rid)
                raise ApiError(502, str(ReplicaLost(rid, exc)), None, "replica_lost", "server_error") from None
            return rid, pid, status, kept, self._chunks(gen, rid)
        raise AssertionError("unreachable")

    async def _chunks(self, gen, rid: str):
        try:
            async for chunk in gen:
                yield chunk
        except RayError as exc:
            self.mark_lost(rid)
            raise ReplicaLost(rid, exc) from None
        finally:
            gen.cancel()  # a no-op once finished; otherwise the replica's relay ends, which aborts the request

    def mark_lost(self, rid: str) -> None:
        self.c_lost.inc()
        self.lost[rid] = time.time()
        log.warning("replica %s was lost; Serve replaces it", rid)

    async def views(self, method: str, path: str, body: bytes = b"") -> dict[str, tuple[dict, int, bytes]]:
        """Every live replica's answer: replica -> (where: pid, socket; status, body). Replicas that fail to
        answer are left out."""
        resp = self.handle.broadcast("fetch", method, path, body)
        try:
            async with asyncio.timeout(VIEW_TIMEOUT):
                results = await resp.results_async(return_exceptions=True)
        except TimeoutError:
            return {}
        return {r[0]: (r[1], r[2], r[3]) for r in results if isinstance(r, tuple)}

    async def json_views(self, method: str, path: str, body: bytes = b"") -> dict[str, tuple[dict, int, dict]]:
        out = {}
        for rid, (where, status, raw) in (await self.views(method, path, body)).items():
            try:
                out[rid] = (where, status, json.loads(raw))
            except ValueError:
                continue
        return out

    def live(self) -> list[str]:
        return routing.live_replicas() or []

    async def watch(self, interval: float = 1.0) -> None:
        """Log replicas that join and leave, and give one that joins (a restart, or autoscaling) the mode the
        cluster was switched to."""
        while True:
            live = set(self.live())
            for rid in sorted(live - self.known):
                log.info("replica %s joined", rid)
                if self.mode is not None:
                    try:
                        _, _, _, _, chunks = await self.open(
                            "PUT",
                            "/v1/engine/mode",
                            {"Content-Type": "application/json"},
                            json.dumps({"mode": self.mode}).encode(),
                            replica=rid,
                        )
                        async for _ in chunks:
                            pass
                    except (ApiError, ReplicaLost) as exc:
                        log.warning("replica %s: could not switch it to %s: %s", rid, self.mode, exc)
                        continue
            for rid in sorted(self.known - live):
                log.info("replica %s left", rid)
            self.known = live
            await asyncio.sleep(interval)

    def prometheus(self) -> bytes:
        self.g_replicas.set(len(self.live()))
        self.g_inflight.set(self.in_flight)
        for name, n in routing.decisions().items():  # counted by the router (its own thread)
            seen = self._routes_seen.get(name, 0)
            if n > seen:
                self.c_routes.labels(name).inc(n - seen)
            else:
                self.c_routes.labels(name)
            self._routes_seen[name] = n
        return generate_latest(self.registry)

"""The ingress: the daemon's API in front of every replica, on a Unix socket and optionally TCP.

Requests pass the daemon's own guard (keys, Host, Origin, content type) and
error middleware here, then go through the Serve handle to a replica, whose
daemon answers them; the answer streams back as it is written, with
`X-Minibatch-Replica` naming the replica. Completions carry their prompt's
block hashes (prefix.py) for the router. The engine views are made here from
every replica's (Serve's broadcast to every live replica): `/health`,
`/v1/engine/stats`, `/v1/engine/events`, both `/v1/engine/mode` and
`/metrics`; `?replica=ID` gives one replica's own view, as it does for
`/v1/engine/steps` and `/v1/engine/blocks`.

A replica lost while it serves a request ends that request with a clear error
(502 `replica_lost`, or an error event in a stream that has begun); a request
that never reached a replica is routed again.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from aiohttp import web

from minibatch.daemon.api.response_store import replica_tag, tag_of
from minibatch.daemon.app import guarded_app
from minibatch.daemon.guard import IDENTITY, IDENTITY_HEADER, LOCAL, Guard
from minibatch.daemon.monitor import EVENT_INTERVAL
from minibatch.daemon.protocol import ApiError
from minibatch.daemon.state import GUARD

from . import aggregate
from .prefix import ROUTED_PATHS, block_hashes, prompt_segments
from .replica_set import ReplicaLost, ReplicaSet

FORWARDED = ("Content-Type", "Accept")


CLUSTER = web.AppKey("cluster", ReplicaSet)


def _ready(cluster: ReplicaSet) -> None:
    if cluster.status == "draining":
        raise ApiError(503, "the cluster is shutting down", None, "shutting_down", "unavailable")
    if cluster.status != "ready":
        msg = "the replicas are still starting" if cluster.status == "loading" else f"failed: {cluster.load_error}"
        raise ApiError(503, msg, None, "not_ready", "unavailable", {"Retry-After": "2"})


def _pin(request: web.Request) -> str | None:
    pin = request.query.get("replica")
    if pin is not None and pin not in request.app[CLUSTER].live():
        raise ApiError(404, f"replica: no live replica {pin!r}", "replica", "replica_not_found")
    return pin


def _path_without_replica(request: web.Request) -> str:
    query = {k: v for k, v in request.query.items() if k != "replica"}
    return request.rel_url.with_query(query).path_qs if query else request.path


async def proxy(request: web.Request) -> web.StreamResponse:
    """Any request a replica's daemon answers: routed by its prompt where it has one."""
    cluster = request.app[CLUSTER]
    _ready(cluster)
    try:
        async with asyncio.timeout(cluster.body_timeout):
            body = await request.read()
    except TimeoutError:
        raise ApiError(408, f"request body not received within {cluster.body_timeout:g} s", None, "timeout") from None
    prefix = None
    if cluster.routing == "prefix" and request.method == "POST" and request.path in ROUTED_PATHS:
        try:
            segments = prompt_segments(request.path, json.loads(body))
        except ValueError:
            segments = None  # the replica refuses it with the daemon's own error
        prefix = block_hashes(segments) if segments else None
    headers = {k: request.headers[k] for k in FORWARDED if k in request.headers}
    headers[IDENTITY_HEADER] = request.get(IDENTITY, LOCAL)  # who the guard here found it was (never the client's)
    counted = not request.path.startswith("/v1/engine/")  # what a drain waits for (not endless event streams)
    cluster.in_flight += counted
    try:
        pin = _pin(request) or _holder(request, body, cluster.live())
        rid, _, status, kept, chunks = await cluster.open(
            request.method, _path_without_replica(request), headers, body, prefix, pin
        )
        resp = web.StreamResponse(status=status)
        for k, v in kept:
            resp.headers.add(k, v)
        resp.headers["X-Minibatch-Replica"] = rid
        await resp.prepare(request)
        try:
            async for chunk in chunks:
                await resp.write(chunk)
        except ReplicaLost as exc:
            await resp.write(_stream_error(resp.content_type, str(exc)))
        await resp.write_eof()
        return resp
    finally:
        cluster.in_flight -= counted


def _holder(request: web.Request, body: bytes, live: list[str]) -> str | None:
    """The replica that stores the response a request reads, deletes or continues (GET / DELETE
    /v1/responses/{id}, or previous_response_id), by the tag its id starts with; None for any other request,
    or when that replica is gone (another answers the 404 an unknown id gets)."""
    rid = None
    if request.path.startswith("/v1/responses/") and request.method in ("GET", "DELETE"):
        rid = request.path[len("/v1/responses/") :]
    elif request.path == "/v1/responses" and request.method == "POST":
        try:
            rid = json.loads(body).get("previous_response_id")
        except (ValueError, AttributeError):
            rid = None
    tag = tag_of(rid) if isinstance(rid, str) else None
    return next((r for r in live if replica_tag(r) == tag), None) if tag else None


def _stream_error(content_type: str, message: str) -> bytes:
    """The end of a stream whose replica died: an error event in the stream's own framing."""
    err = ApiError(502, message, None, "replica_lost", "server_error")
    if content_type == "text/event-stream":
        return b"data: " + json.dumps(err.body()).encode() + b"\n\n"
    if content_type == "application/x-ndjson":  # Ollama's streams
        return json.dumps({"error": message}).encode() + b"\n"
    return b""


async def health(request: web.Request) -> web.Response:
    cluster = request.app[CLUSTER]
    views = await cluster.json_views("GET", "/health") if cluster.status in ("ready", "draining") else {}
    replicas = [
        {
            "replica": rid,
            **where,  # its pid, and its daemon's own socket on its machine
            "status": body.get("status"),
            "mode": body.get("mode"),
            "last_error": body.get("last_error"),
        }
        for rid, (where, _, body) in sorted(views.items())
    ]
    ok_bodies = [body for _, (_, status, body) in sorted(views.items()) if status == 200]
    ok = cluster.status == "ready" and bool(ok_bodies)
    status = "ok" if ok else cluster.status if cluster.status != "ready" else "failed"
    body: dict = dict(ok_bodies[0]) if ok_bodies else {"model": cluster.model_name}
    body |= {
        "status": status,
        "uptime_s": round(time.time() - cluster.started_at, 1),
        "pid": os.getpid(),
        "mode": aggregate.common_mode([r["mode"] for r in replicas]),
        "last_error": cluster.load_error if not ok_bodies else body.get("last_error"),
        "cluster": {"replicas": replicas, "wanted": cluster.wanted, "routing": cluster.routing},
    }
    return web.json_response(body, status=200 if ok else 503)


async def engine_stats(request: web.Request) -> web.Response:
    cluster = request.app[CLUSTER]
    _ready(cluster)
    pin = _pin(request)
    views = await cluster.json_views("GET", _path_without_replica(request))
    bad = next(((s, b) for _, s, b in views.values() if s != 200), None)
    if bad is not None:  # a bad ?steps= is refused alike by every replica
        return web.json_response(bad[1], status=bad[0])
    if pin is not None:
        return web.json_response({"replica": pin, **views[pin][2]})
    return web.json_response(aggregate.stats({rid: body for rid, (_, _, body) in views.items()}))


async def engine_events(request: web.Request) -> web.StreamResponse:
    """One replica's events (?replica=), or the cluster's: each replica's latest merged, at most every
    EVENT_INTERVAL, replicas that join picked up within a second."""
    cluster = request.app[CLUSTER]
    _ready(cluster)
    if request.query.get("replica") is not None:
        return await proxy(request)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    latest: dict[str, dict] = {}
    changed = asyncio.Event()
    tasks: dict[str, asyncio.Task] = {}

    async def follow(rid: str) -> None:
        try:
            _, _, status, _, chunks = await cluster.open("GET", "/v1/engine/events", {}, b"", replica=rid)
            buf = b""
            async for chunk in chunks:
                buf += chunk
                *events, buf = buf.split(b"\n\n")
                for ev in events:
                    if ev.startswith(b"data: "):
                        latest[rid] = json.loads(ev[6:])
                        changed.set()
        except (ApiError, ReplicaLost, ValueError):
            pass
        finally:
            latest.pop(rid, None)
            changed.set()

    try:
        while True:
            live = set(cluster.live())
            for rid in live - set(tasks):
                tasks[rid] = asyncio.ensure_future(follow(rid))
            for rid in [r for r, t in tasks.items() if t.done() or r not in live]:
                tasks.pop(rid).cancel()
            try:
                async with asyncio.timeout(1.0):
                    await changed.wait()
            except TimeoutError:
                continue
            changed.clear()
            if latest:
                event = aggregate.event(dict(latest), time.time())
                await resp.write(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")
            await asyncio.sleep(EVENT_INTERVAL)
    finally:
        for t in tasks.values():
            t.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)


async def one_replica(request: web.Request) -> web.StreamResponse:
    """/v1/engine/steps and /v1/engine/blocks: the replica named by ?replica=, else the first live one."""
    cluster = request.app[CLUSTER]
    _ready(cluster)
    if request.query.get("replica") is None:
        live = cluster.live()
        if not live:
            raise ApiError(503, "no replica is live", None, "no_replica", "unavailable")
        request = request.clone(rel_url=request.rel_url.update_query(replica=live[0]))
    return await proxy(request)


async def get_mode(request: web.Request) -> web.Response:
    cluster = request.app[CLUSTER]
    _ready(cluster)
    views = await cluster.json_views("GET", "/v1/engine/mode")
    reps = [{"replica": rid, **body} for rid, (_, _, body) in sorted(views.items())]
    return web.json_response(
        {
            "mode": aggregate.common_mode([r.get("mode") for r in reps]),
            "pending_mode": aggregate.common_mode([r.get("pending_mode") for r in reps]),
            "replicas": reps,
        }
    )


async def put_mode(request: web.Request) -> web.Response:
    """Switch every replica; a body the daemon refuses is refused once, as the daemon words it."""
    cluster = request.app[CLUSTER]
    _ready(cluster)
    body = await request.read()
    views = await cluster.json_views("PUT", "/v1/engine/mode", body)
    if not views:
        raise ApiError(503, "no replica answered", None, "no_replica", "unavailable")
    refused = next(((s, b) for _, s, b in views.values() if s >= 400), None)
    if refused is not None:
        return web.json_response(refused[1], status=refused[0])
    reps = [{"replica": rid, **b} for rid, (_, _, b) in sorted(views.items())]
    cluster.mode = reps[0].get("requested_mode")
    return web.json_response(
        {
            "mode": aggregate.common_mode([r.get("mode") for r in reps]),
            "requested_mode": cluster.mode,
            "replicas": reps,
        },
        status=202,
    )


async def metrics(request: web.Request) -> web.Response:
    cluster = request.app[CLUSTER]
    texts = {}
    if cluster.status in ("ready", "draining"):
        texts = {rid: raw.decode() for rid, (_, s, raw) in (await cluster.views("GET", "/metrics")).items() if s == 200}
    own = (cluster.prometheus() + request.app[GUARD].prometheus()).decode()
    return web.Response(
        text=aggregate.metrics(texts, own), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )


def create_app(cluster: ReplicaSet, guard: Guard | None = None) -> web.Application:
    app = guarded_app(guard)
    app[CLUSTER] = cluster
    app.router.add_get("/health", health)
    app.router.add_get("/v1/engine/stats", engine_stats)
    app.router.add_get("/v1/engine/events", engine_events)
    app.router.add_get("/v1/engine/steps", one_replica)
    app.router.add_get("/v1/engine/blocks", one_replica)
    app.router.add_get("/v1/engine/mode", get_mode)
    app.router.add_put("/v1/engine/mode", put_mode)
    app.router.add_get("/metrics", metrics)
    app.router.add_route("*", "/{tail:.*}", proxy)  # the rest of the daemon's API, answered by a replica
    return app

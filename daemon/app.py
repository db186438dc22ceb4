"""The HTTP API on the socket: the app, its error middleware, the daemon's own endpoints (health, models, the
engine's stats, events, timeline, blocks and mode, metrics, the OpenAPI document) and the four API faces'
routes (openai.py, ollama.py, anthropic.py, responses.py), each over the one pipeline (pipeline.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time

from aiohttp import web

from minibatch.engine.core.timeline import STATES
from minibatch.engine.kv_offload.disk import summary

from .api import anthropic, embeddings, llama, ollama, openai, openapi, rerank, response_store, responses, tokens
from .api.schemas import ModeRequest
from .guard import Guard, guard_middleware
from .models.catalog import catalog
from .models.names import cut, display_name, normal_name
from .monitor import COMPACT, STATS_SUMMED
from .protocol import ApiError, parse_body
from .state import GUARD, STATE, DaemonState, read_raw

log = logging.getLogger("minibatch.daemon")
OPENAPI = web.AppKey("openapi", bytes)  # the document, made on first request


@web.middleware
async def errors(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as exc:
        return web.json_response(error_body(request, exc), status=exc.status, headers=exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err = ApiError(exc.status, exc.reason, None, exc.reason.lower().replace(" ", "_"))
        body = error_body(request, err)
        return web.json_response(
            body, status=exc.status, headers={k: v for k, v in exc.headers.items() if k == "Allow"}
        )
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        err = ApiError(500, "internal error; see the daemon log", None, "internal", "server_error")
        return web.json_response(error_body(request, err), status=500)


def error_body(request: web.Request, exc: ApiError) -> dict:
    """The error in the shape of the API the request speaks: Ollama's, Anthropic's, else OpenAI's."""
    if ollama.owns(request):
        return ollama.error_body(exc)
    if anthropic.owns(request):
        return anthropic.error_body(exc)
    return exc.body()


async def health(request: web.Request) -> web.Response:
    """The daemon, and every loaded model's facts (`models`); the top level keeps the daemon's own model's
    facts, as before there were several."""
    state = request.app[STATE]
    pool = state.pool
    m = pool.default() if pool is not None else None
    ok = state.status == "ready" and (m is None or m.engine.alive) and not (pool and pool.lost.is_set())
    body = {
        "status": "ok" if ok else state.status if state.status != "ready" else "failed",
        "model": m.name if m else state.model_name,
        "uptime_s": round(time.time() - state.started_at, 1),
        "last_error": (m.engine.fatal_error or m.engine.last_error) if m else state.load_error,
        "last_error_time": m.engine.last_error_time if m else None,
        "pid": os.getpid(),
    }
    if m is not None:  # the model's facts, and the mode as it is now (it changes at run time)
        body |= m.info.as_dict(public=True) | m.adapters.facts() | {"mode": m.engine.mode}
    if pool is not None:
        body["models"] = [x.facts() for x in pool.models.values()]
        body["loading"] = sorted(pool.loading)
        body["load_errors"] = dict(pool.failed)
    return web.json_response(body, status=200 if ok else 503)


async def models(request: web.Request) -> web.Response:
    """Every model this daemon can serve: the loaded ones first, then what `minibatchd models` lists."""
    state = request.app[STATE]
    entries = await catalog(state)
    data = [
        {
            "id": entry["id"],
            "object": "model",
            "created": entry["created"],
            "owned_by": "minibatch",
            "loaded": entry["loaded"],
            "max_model_len": entry["max_model_len"],
            "parent": None,
            "vision": entry["vision"],
        }
        for entry in entries
    ]
    # each LoRA adapter after its base model, which it is served over (vLLM's `parent`)
    for adapter, base in state.check_serving().adapter_names().items():
        card = next(
            (c for c in data if normal_name(c["id"]) in (normal_name(base), normal_name(display_name(base)))), None
        )
        parent = card["id"] if card is not None else display_name(base)
        data.append(
            {
                **(card or {"created": 0, "loaded": False, "max_model_len": None}),
                "id": adapter,
                "object": "model",
                "owned_by": "minibatch",
                "parent": parent,
            }
        )
    return web.json_response({"object": "list", "data": data})


def model_param(request: web.Request) -> str | None:
    """?model=NAME: which loaded model an engine endpoint shows (default: the daemon's own)."""
    return request.query.get("model") or None


async def engine_stats(request: web.Request) -> web.Response:
    """One model's engine (?model=, default the daemon's own) at the top level; with several loaded,
    `models` holds each one's and `totals` their sums."""
    state = request.app[STATE]
    n = request.query.get("steps", "20")
    if not (n.isascii() and n.isdigit()) or int(n) > 600:
        raise ApiError(400, "steps: must be an integer in [0, 600]", "steps", "invalid_value")
    name = model_param(request)
    m = state.served(name)
    body = m.monitor.snapshot(m.ready_engine(), int(n)) | {"model": m.name}
    if name is None:
        loaded = list(state.pool.models.values())
        each = {x.name: x.monitor.snapshot(x.engine, 0) for x in loaded}
        body["models"] = {k: {f: v[f] for f in COMPACT} for k, v in each.items()}
        body["totals"] = {f: sum(v[f] for v in each.values()) for f in STATS_SUMMED}
    return web.json_response(body)


async def engine_events(request: web.Request) -> web.StreamResponse:
    """One model's steps as SSE (?model=); each event also carries `models`: every loaded model's bars."""
    state = request.app[STATE]
    m = state.served(model_param(request))
    engine = m.ready_engine()
    pool = state.pool
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    async for event in m.monitor.events(engine, others=lambda: models_summary(pool)):
        event["model"] = m.name
        await resp.write(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")
        if not m.loaded:
            break
    return resp


def models_summary(pool) -> dict:
    """Every loaded or loading model's compact line (monitor.COMPACT), for the chat's bars."""
    out = {}
    for x in pool.models.values():
        snap = x.monitor.snapshot(x.engine, 0)
        out[x.name] = {"state": "ready" if x.engine.alive else "failed", **{f: snap[f] for f in COMPACT}}
    for name in pool.loading:
        out.setdefault(name, {"state": "loading"})
    return out


async def engine_steps(request: web.Request) -> web.Response:
    """The timeline: step records after ?since=STEP (rows: [row, request id, tokens, state, ...]; STATES)."""
    m = request.app[STATE].served(model_param(request))
    engine = m.ready_engine()
    since = request.query.get("since", "0")
    if not (since.isascii() and since.isdigit()):
        raise ApiError(400, "since: must be a step number (a non-negative integer)", "since", "invalid_value")
    last_step, capacity, records = engine.timeline_since(int(since))
    return web.json_response(
        {
            "model": m.name,
            "last_step": last_step,
            "capacity": capacity,
            "max_rows": engine.state.max_num_seqs,
            "states": STATES,
            "steps": [r.as_dict() for r in records],
        }
    )


async def engine_blocks(request: web.Request) -> web.Response:
    """KV blocks by owning request (ids as returned in responses), blocks shared by several, cached free blocks."""
    m = request.app[STATE].served(model_param(request))
    return web.json_response(m.ready_engine().block_map | {"model": m.name})


async def get_mode(request: web.Request) -> web.Response:
    m = request.app[STATE].served(model_param(request))
    st = m.ready_engine().state
    return web.json_response({"model": m.name, "mode": st.mode, "pending_mode": st.pending_mode})


async def put_mode(request: web.Request) -> web.Response:
    """Switch one model (?model=) or, without it, every loaded model."""
    state = request.app[STATE]
    name = model_param(request)
    targets = [state.served(name)] if name else list(state.check_serving().models.values())
    if not targets:
        state.served(None)  # says why nothing can switch
    engines = [m.ready_engine() for m in targets]
    mode = parse_body(await read_raw(request, state), ModeRequest).mode
    for engine in engines:
        engine.set_mode(mode)
    # The switch is applied on the engine thread at the next batch boundary.
    body = {"mode": engines[0].state.mode, "requested_mode": mode, "models": [m.name for m in targets]}
    return web.json_response(body, status=202)


def _prompt_cache(state: DaemonState):
    """(the disk prompt cache of the daemon's folder or None when it has none, its budget, whether it is on)."""
    from minibatch.engine.kv_offload.disk import default_folder, inspect, open_cache

    base = state.check_serving().base
    folder = base.prompt_cache_dir or default_folder()
    on = base.prompt_cache_gb > 0 and base.enable_prefix_caching
    budget = int(base.prompt_cache_gb * 2**30)
    return (open_cache(folder, budget) if on else inspect(folder)), budget, on


def _loaded_identities(state: DaemonState) -> dict[str, str]:
    out = {}
    for m in state.check_serving().models.values():
        tier = m.engine.engine.tier
        if tier is not None:
            out[tier.identity] = m.name
    return out


# What a client other than the daemon's own user is shown of each model with blocks on disk: no counts (the
# folder's blocks are every key's prompts: they would tell one key another's activity) and names, not paths
SHOWN_TO_KEYS = ("loaded", "kv_cache_type", "block_size", "weights")


async def prompt_cache(request: web.Request) -> web.Response:
    """The disk prompt cache: its bytes against --prompt-cache-gb, and each model's blocks, the folder and
    the models' paths, for the daemon's own user; for any other client whether it is on, its budget, and
    which models have blocks there (SHOWN_TO_KEYS)."""
    state = request.app[STATE]
    cache, budget, on = await asyncio.to_thread(_prompt_cache, state)
    body = {"enabled": on} | await asyncio.to_thread(summary, cache, budget, _loaded_identities(state))
    if not state.is_operator(request):
        models = [{"model": cut(display_name(m["model"]))} | {k: m[k] for k in SHOWN_TO_KEYS} for m in body["models"]]
        return web.json_response({"enabled": on, "budget_bytes": budget, "models": models})
    if cache is not None:
        body["folder"] = str(cache.root)
    return web.json_response(body)


async def clear_prompt_cache(request: web.Request) -> web.Response:
    """Remove the disk prompt cache's blocks: of one model (?model=, as listed) or all; the daemon's own user
    only (over the socket, without a key)."""
    state = request.app[STATE]
    if not state.is_operator(request):
        raise ApiError(
            403, "only the daemon's own user (over its socket) may clear the prompt cache", None, "forbidden"
        )
    if request.query.get("model", None) == "":
        raise ApiError(400, "model: empty; name a model as listed, or leave model out to clear them all", "model")
    cache, budget, _ = await asyncio.to_thread(_prompt_cache, state)
    name = model_param(request)
    if cache is None:
        return web.json_response({"removed_blocks": 0, "removed_bytes": 0})
    listed = (await asyncio.to_thread(summary, cache, budget, _loaded_identities(state)))["models"]
    identities = [None] if name is None else [m["identity"] for m in listed if name in (m["model"], m["identity"])]
    if not identities:
        raise ApiError(404, f"model: the prompt cache holds no blocks of {cut(name)!r}", "model", "model_not_found")
    removed = [await asyncio.to_thread(cache.clear, ident) for ident in identities]
    return web.json_response(
        {"removed_blocks": sum(r[0] for r in removed), "removed_bytes": sum(r[1] for r in removed)}
    )


async def openapi_json(request: web.Request) -> web.Response:
    state = request.app[STATE]
    m = state.pool.find(None) if state.pool else None
    if OPENAPI not in request.app or m is None:  # made once the model's facts are known
        request.app[OPENAPI] = json.dumps(openapi.document(state.model_name, m.info.vocab_size if m else None)).encode()
    return web.Response(body=request.app[OPENAPI], content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.pool is not None:
        for m in state.pool.models.values():
            m.monitor.sync_disk(m.engine.state)
        if state.pool.base.prompt_cache_gb > 0:
            with contextlib.suppress(OSError):  # (a folder it cannot make: its loads logged why)
                cache, _, _ = _prompt_cache(state)
                state.pool.metrics.disk_bytes.set(cache.bytes)
                state.pool.metrics.disk_evicted.set(cache.evicted_blocks)
    body = (state.pool.metrics.prometheus() if state.pool else b"") + request.app[GUARD].prometheus()
    body += request.app[response_store.STORE].prometheus()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def guarded_app(guard: Guard | None = None) -> web.Application:
    """An app with the API's error shapes, the listener guard (app[GUARD]) and its CORS answers: the daemon's,
    and the cluster ingress's in front of it."""
    guard = guard or Guard()
    app = web.Application(middlewares=[errors, guard_middleware(guard)], client_max_size=8 * 2**20)
    app[GUARD] = guard

    async def cors(request: web.Request, response: web.StreamResponse) -> None:
        guard.cors_headers(request, response)

    app.on_response_prepare.append(cors)
    return app


def create_app(state: DaemonState, guard: Guard | None = None) -> web.Application:
    app = guarded_app(guard)
    app[STATE] = state
    app.router.add_get("/health", health)
    app.router.add_get("/openapi.json", openapi_json)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/engine/stats", engine_stats)
    app.router.add_get("/v1/engine/events", engine_events)
    app.router.add_get("/v1/engine/blocks", engine_blocks)
    app.router.add_get("/v1/engine/steps", engine_steps)
    app.router.add_get("/v1/engine/mode", get_mode)
    app.router.add_put("/v1/engine/mode", put_mode)
    app.router.add_get("/v1/prompt-cache", prompt_cache)
    app.router.add_delete("/v1/prompt-cache", clear_prompt_cache)
    app.router.add_get("/metrics", metrics)
    openai.add_routes(app)
    ollama.add_routes(app)
    anthropic.add_routes(app)
    responses.add_routes(app)
    tokens.add_routes(app)
    embeddings.add_routes(app)
    rerank.add_routes(app)
    llama.add_routes(app)
    return app

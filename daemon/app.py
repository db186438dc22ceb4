"""The HTTP API on the socket: thin handlers (validate -> engine -> respond or stream)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

from minibatch.engine.core.info import EngineInfo
from minibatch.engine.core.scheduler import MODES, QueueFull, RequestRejected

from .guard import Guard, guard_middleware
from .protocol import ApiError, ChatRequest, CompletionRequest, parse_body
from .responses import full_response, stream_response, timeout_message
from .grammars import check_tool_schemas, forced_call, response_grammar, tool_call_grammar
from .tools import check_template, tool_specs

log = logging.getLogger("minibatch.daemon")
DEFAULT_MAX_TOKENS = 1024


@dataclass
class DaemonState:
    model_name: str
    request_timeout: float = 600.0  # wall-clock limit per request, seconds
    body_timeout: float = 30.0  # seconds to receive a request body
    engine: object | None = None  # AsyncEngine once loaded
    monitor: object | None = None
    tokenizer: object | None = None
    grammars: object | None = None  # engine.structured.GrammarCompiler, when the tokenizer allows one
    info: EngineInfo | None = None  # the engine's facts, once loaded
    started_at: float = field(default_factory=time.time)
    status: str = "loading"  # loading | ready | draining | failed
    load_error: str | None = None

    def ready_engine(self):
        if self.status == "draining":
            raise ApiError(503, "the daemon is shutting down", None, "shutting_down", "unavailable")
        if self.status != "ready" or self.engine is None:
            msg = "the model is still loading" if self.status == "loading" else f"the engine is not available: {self.load_error}"
            raise ApiError(503, msg, None, "not_ready", "unavailable", {"Retry-After": "2"})
        if not self.engine.alive:
            why = self.engine.fatal_error or "the engine thread has stopped"
            raise ApiError(503, f"{why}; see the log", None, "engine_dead", "unavailable")
        return self.engine


STATE = web.AppKey("state", DaemonState)
GUARD = web.AppKey("guard", Guard)


@web.middleware
async def errors(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as exc:
        body = {"error": exc.message} if request.path.startswith("/api/") else exc.body()  # Ollama's error shape
        return web.json_response(body, status=exc.status, headers=exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err = ApiError(exc.status, exc.reason, None, exc.reason.lower().replace(" ", "_"))
        body = {"error": err.message} if request.path.startswith("/api/") else err.body()
        return web.json_response(body, status=exc.status, headers={k: v for k, v in exc.headers.items() if k == "Allow"})
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return web.json_response(ApiError(500, "internal error; see the daemon log", None, "internal", "server_error").body(), status=500)


async def read_body(request: web.Request, state: DaemonState, model):
    try:
        raw = await asyncio.wait_for(request.read(), state.body_timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"request body not received within {state.body_timeout:g} s", None, "timeout") from None
    return parse_body(raw, model)


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    eng = state.engine
    ok = state.status == "ready" and eng is not None and eng.alive
    body = {
        "status": "ok" if ok else state.status if state.status != "ready" else "failed",
        "model": state.model_name, "uptime_s": round(time.time() - state.started_at, 1),
        "last_error": (eng.fatal_error or eng.last_error) if eng else state.load_error,
        "last_error_time": eng.last_error_time if eng else None, "pid": os.getpid(),
    }
    if state.info is not None:  # the model's facts, and the mode as it is now (it changes at run time)
        body |= state.info.as_dict() | {"mode": eng.mode}
    return web.json_response(body, status=200 if ok else 503)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    data = [{"id": state.model_name, "object": "model", "created": int(state.started_at), "owned_by": "minibatch",
             "max_model_len": state.info.max_model_len if state.info else None}]
    return web.json_response({"object": "list", "data": data})


def check_model(state: DaemonState, name: str | None) -> None:
    # Ollama's names carry a tag; clients that list models over /api/tags send it back here (as oterm does)
    if name is not None and name not in (state.model_name, f"{state.model_name}:latest", "default"):
        raise ApiError(404, f"model {name!r} does not exist; this daemon serves {state.model_name!r}", "model", "model_not_found")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body: ChatRequest = await read_body(request, state, ChatRequest)
    check_model(state, body.model)
    engine = state.ready_engine()
    specs = tool_specs(body)
    if specs is not None:
        check_template(state.tokenizer)
    try:
        ids = state.tokenizer.chat([m.for_template() for m in body.messages], tools=specs)
    except ValueError as exc:
        raise ApiError(400, str(exc), "messages", "no_chat_template") from None
    if body.max_completion_tokens and not body.max_tokens:
        body.max_tokens = body.max_completion_tokens
    make_grammar = None
    if specs is not None:
        await check_tool_schemas(state, specs)
        forced = forced_call(body, specs)
        if forced is not None:  # each completion gets its own grammar state
            make_grammar = lambda: tool_call_grammar(state, *forced)  # noqa: E731
    return await run_request(request, state, engine, body, ids, "chat.completion", f"chatcmpl-{uuid.uuid4().hex}",
                             make_grammar=make_grammar, tools=specs is not None)


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body: CompletionRequest = await read_body(request, state, CompletionRequest)
    check_model(state, body.model)
    engine = state.ready_engine()
    ids = list(body.prompt) if isinstance(body.prompt, list) else state.tokenizer.encode_prompt(body.prompt)
    vocab = state.info.vocab_size
    if any(t >= vocab for t in ids):
        raise ApiError(400, f"prompt: token ids must be below the vocabulary size {vocab}", "prompt", "invalid_value")
    return await run_request(request, state, engine, body, ids, "text_completion", f"cmpl-{uuid.uuid4().hex}")


def submit(state: DaemonState, engine, body, ids: list[int], request_id: str, grammar=None, index: int = 0,
           share_prompt_with: str | None = None) -> None:
    limit = state.info.max_model_len
    if not ids:
        raise ApiError(400, "the prompt is empty", "messages" if isinstance(body, ChatRequest) else "prompt", "empty_prompt")
    if limit and len(ids) >= limit:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; the context limit is {limit}", "messages", "context_length_exceeded")
    params = body.sampling_params(min(DEFAULT_MAX_TOKENS, limit - len(ids)) if limit else DEFAULT_MAX_TOKENS,
                                  state.info.generation_defaults)
    params.grammar = grammar
    if index and params.seed is not None:  # the n completions of one request draw differently, reproducibly
        params.seed = (params.seed + index) % 2**63
    try:
        engine.submit(ids, params, request_id, share_prompt_with)
    except QueueFull as exc:
        raise ApiError(429, str(exc), None, "queue_full", "rate_limit_error", {"Retry-After": "1"}) from None
    except RequestRejected as exc:
        raise ApiError(exc.status, str(exc), exc.field, "context_length_exceeded" if "context" in str(exc) else "rejected") from None


async def run_request(request, state: DaemonState, engine, body, ids, kind: str, request_id: str, make_grammar=None,
                      tools: bool = False):
    """Submit the request's n completions (the first computes the prompt, the others borrow its KV blocks) and
    answer with their choices; `make_grammar` gives each completion its own grammar state."""
    if make_grammar is None:
        make_grammar = lambda: response_grammar(state, body.response_format, "response_format")  # noqa: E731
    grammars = [await make_grammar() for _ in range(body.n)]
    ids_n = [request_id] if body.n == 1 else [f"{request_id}-{i}" for i in range(body.n)]
    for i, rid in enumerate(ids_n):
        try:
            submit(state, engine, body, ids, rid, grammars[i], i, ids_n[0] if i else None)
        except ApiError:
            for done in ids_n[:i]:  # all n or none
                engine.abort(done)
                async for _ in engine.stream(done):
                    pass
            raise
    base = {"id": request_id, "created": int(time.time()), "model": state.model_name}
    chat = kind == "chat.completion"
    # Leaving these iterators early (timeout, client gone) aborts the requests and frees their blocks.
    streams = [engine.stream(rid) for rid in ids_n]
    try:
        if body.stream:
            return await stream_response(request, state, streams, base, chat, len(ids), body.include_usage, tools)
        try:
            async with asyncio.timeout(state.request_timeout):
                return await full_response(state, streams, base, chat, len(ids), tools)
        except TimeoutError:
            raise ApiError(504, timeout_message(state), None, "timeout") from None
    finally:
        for stream in streams:
            await stream.aclose()


async def engine_stats(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.ready_engine()
    n = request.query.get("steps", "20")
    if not n.isdigit() or int(n) > 600:
        raise ApiError(400, "steps: must be an integer in [0, 600]", "steps", "invalid_value")
    return web.json_response(state.monitor.snapshot(engine, int(n)))


async def engine_events(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    engine = state.ready_engine()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    async for event in state.monitor.events(engine):
        await resp.write(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")
    return resp


async def engine_steps(request: web.Request) -> web.Response:
    """The timeline: step records after ?since=STEP (rows: [row, request id, tokens, state]; states p d x h)."""
    engine = request.app[STATE].ready_engine()
    since = request.query.get("since", "0")
    if not since.isdigit():
        raise ApiError(400, "since: must be a step number (a non-negative integer)", "since", "invalid_value")
    timeline = engine.engine.timeline
    records = timeline.since(int(since))
    return web.json_response({"last_step": timeline.last_step, "capacity": timeline.capacity,
                              "max_rows": engine.engine.scheduler.config.max_num_seqs,
                              "states": {"p": "prefill", "d": "decode", "x": "padding", "h": "held"},
                              "steps": [r.as_dict() for r in records]})


async def engine_blocks(request: web.Request) -> web.Response:
    """KV blocks by owning request (ids as returned in responses), blocks shared by several, cached free blocks."""
    engine = request.app[STATE].ready_engine()
    return web.json_response(engine.block_map)


async def get_mode(request: web.Request) -> web.Response:
    engine = request.app[STATE].ready_engine()
    sched = engine.engine.scheduler
    return web.json_response({"mode": sched.mode, "pending_mode": sched.pending_mode})


async def put_mode(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.ready_engine()
    try:
        data = json.loads(await asyncio.wait_for(request.read(), state.body_timeout))
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "body is not valid JSON", None, "invalid_json") from None
    mode = data.get("mode") if isinstance(data, dict) else None
    if mode not in MODES or set(data) != {"mode"}:
        raise ApiError(400, f"mode: must be one of {', '.join(MODES)} (body: {{\"mode\": ...}})", "mode", "invalid_value")
    engine.set_mode(mode)
    sched = engine.engine.scheduler
    # The switch is applied on the engine thread at the next batch boundary.
    return web.json_response({"mode": sched.mode, "requested_mode": mode}, status=202)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = (state.monitor.prometheus() if state.monitor else b"") + request.app[GUARD].prometheus()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def create_app(state: DaemonState, guard: Guard | None = None) -> web.Application:
    guard = guard or Guard()
    app = web.Application(middlewares=[errors, guard_middleware(guard)], client_max_size=8 * 2**20)
    app[STATE], app[GUARD] = state, guard

    async def cors(request: web.Request, response: web.StreamResponse) -> None:
        guard.cors_headers(request, response)

    app.on_response_prepare.append(cors)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/engine/stats", engine_stats)
    app.router.add_get("/v1/engine/events", engine_events)
    app.router.add_get("/v1/engine/blocks", engine_blocks)
    app.router.add_get("/v1/engine/steps", engine_steps)
    app.router.add_get("/v1/engine/mode", get_mode)
    app.router.add_put("/v1/engine/mode", put_mode)
    app.router.add_get("/metrics", metrics)
    from .ollama import add_routes

    add_routes(app)
    return app

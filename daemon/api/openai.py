"""OpenAI's Chat Completions and Completions on the socket: `POST /v1/chat/completions`, `POST /v1/completions`.

Only the shapes live here: a body (protocol.py) becomes a generation.spec.Generation; what the pipeline gives back
becomes a `chat.completion` / `text_completion` object or a stream of SSE chunks ending in [DONE]; errors
keep the OpenAI shape (ApiError.body).
"""

from __future__ import annotations

import json
import time
import uuid

from aiohttp import web

from minibatch.engine.core.request import RequestMetrics

from ..generation.pipeline import Running, generate
from ..generation.spec import Constraint, Generation, Reasoning
from ..models.names import cut
from ..protocol import ApiError
from ..state import STATE, read_body
from .openai_bodies import ChatRequest, CompletionRequest

# a SamplingParams field -> what the OpenAI bodies call it, where the names differ
NAMES = {"logprobs": "top_logprobs"}


# -- bodies into the pipeline's terms ----------------------------------------------------------------------
def chat_generation(body: ChatRequest) -> Generation:
    specs = tool_specs(body)
    forced = forced_call(body, specs) if specs is not None else None
    given, defaults = body.sampling()
    if body.max_completion_tokens and not body.max_tokens:
        given["max_tokens"] = body.max_completion_tokens
    return Generation(
        request_id=f"chatcmpl-{uuid.uuid4().hex}",
        model=body.model,
        prompt_field="messages",
        messages=[m.for_template(f"messages.{i}") for i, m in enumerate(body.messages)],
        tools=specs,
        reasoning=Reasoning.asked(
            body.reasoning_effort,
            body.max_reasoning_tokens,
            {"auto": True, "none": False}.get(body.reasoning_format or ""),
            body.chat_template_kwargs,
        ),
        sampling=given,
        api_defaults=defaults,
        names={**NAMES, "max_tokens": "max_tokens" if body.max_tokens else "max_completion_tokens"},
        n=body.n,
        constraint=_constraint(body, forced),
        stream_interval=body.stream_interval,
        lora=body.lora,
    )


def completion_generation(body: CompletionRequest) -> Generation:
    fill = body.fill()
    prompts, batch = body.prompts() if fill is None else (None, False)
    given, defaults = body.sampling()
    return Generation(
        request_id=f"cmpl-{uuid.uuid4().hex}",
        model=body.model,
        prompt_field="prompt",
        prompts=prompts,
        fill=fill,
        batch=batch,
        sampling=given,
        api_defaults=defaults,
        names={},
        n=body.n,
        constraint=_constraint(body, None),
        stream_interval=body.stream_interval,
        lora=body.lora,
    )


def _constraint(body: ChatRequest | CompletionRequest, forced) -> Constraint | None:
    fmt = body.response_format
    if body.grammar is not None:
        if forced is not None or (fmt is not None and fmt.type != "text"):
            other = "a required tool call" if forced is not None else "response_format"
            raise ApiError(400, f"grammar: cannot be combined with {other}", "grammar", "invalid_value")
        return Constraint("grammar", grammar=body.grammar)
    if forced is not None:
        return Constraint("tools", call=forced)
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint("response_format", fmt="json")
    if fmt.json_schema is None:
        raise ApiError(
            400,
            "response_format.json_schema: required when type is json_schema",
            "response_format.json_schema",
            "missing",
        )
    if fmt.json_schema.schema_ is None:
        where = "response_format.json_schema.schema"
        raise ApiError(400, f"{where}: required when type is json_schema", where, "missing")
    return Constraint("response_format.json_schema.schema", fmt=fmt.json_schema.schema_)


def tool_specs(body: ChatRequest) -> list[dict] | None:
    """The request's tools as the template and the grammar take them, or None when none apply."""
    if not body.tools or body.tool_choice == "none":
        if body.tool_choice not in (None, "none", "auto"):
            raise ApiError(
                400, "tool_choice: a call is required but the request offers no tools", "tool_choice", "invalid_value"
            )
        return None
    return [t.model_dump(exclude_none=True) for t in body.tools]


def forced_call(body: ChatRequest, specs: list[dict]) -> tuple[list[dict], str | None] | None:
    """(the functions, the one named or None for any) when tool_choice requires a call, else None."""
    choice = body.tool_choice
    if choice in (None, "auto", "none"):
        return None
    functions = [s["function"] for s in specs]
    name = None
    if choice != "required":
        name = choice.function.name
        if name not in {f["name"] for f in functions}:
            raise ApiError(
                400,
                f"tool_choice.function.name: no tool named {cut(name)!r} in tools",
                "tool_choice.function.name",
                "invalid_value",
            )
    if body.response_format is not None and body.response_format.type != "text":
        raise ApiError(
            400, "response_format: cannot be combined with a required tool call", "response_format", "invalid_value"
        )
    return functions, name


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body: ChatRequest = await read_body(request, state, ChatRequest)
    async with generate(state, chat_generation(body), request) as run:
        return await answer(request, run, body, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body: CompletionRequest = await read_body(request, state, CompletionRequest)
    async with generate(state, completion_generation(body), request) as run:
        return await answer(request, run, body, chat=False)


async def answer(request: web.Request, run: Running, body, chat: bool) -> web.StreamResponse:
    base = {"id": run.gen.request_id, "created": int(time.time()), "model": run.name}
    if body.stream:
        return await stream_response(request, run, base, chat, body.include_usage)
    return await full_response(run, base, chat)


# -- answers in OpenAI's shapes ----------------------------------------------------------------------------
def timings(m: RequestMetrics | None) -> dict:
    def ms(v):
        return None if v is None else round(v * 1000, 3)

    if m is None:
        return {}
    return {
        "queue_wait_ms": ms(m.queue_wait),
        "ttft_ms": ms(m.ttft),
        "decode_ms": ms(m.decode_time),
        "tpot_ms": ms(m.tpot),
        "e2e_ms": ms(m.e2e),
        "preemptions": m.preemptions,
        "cached_prompt_tokens": m.cached_prompt_tokens,
        "draft_tokens": m.draft_tokens,
        "accepted_tokens": m.accepted_tokens,
    }


def usage(m: RequestMetrics | None, prompt_tokens: int, completion_tokens: int, reasoning_tokens: int = 0) -> dict:
    cached = m.cached_prompt_tokens if m else 0
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
    }


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer, token_ids: list[int], entries: list) -> list[dict]:
    """`choices[].logprobs.content` items: each token, its log-probability, its bytes, and the top alternatives."""

    def item(tid: int, lp: float) -> dict:
        text = token_text(tokenizer, tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return [
        {**item(tid, lp), "top_logprobs": [item(t, v) for t, v in top]} for tid, (lp, top) in zip(token_ids, entries)
    ]


def completion_logprobs(tokenizer, token_ids: list[int], entries: list, offset: int = 0) -> dict:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs (token -> logprob), text_offset."""
    tokens = [token_text(tokenizer, t) for t in token_ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _ in entries],
        "top_logprobs": [{token_text(tokenizer, t): v for t, v in top} for _, top in entries],
        "text_offset": offsets,
    }


async def full_response(run: Running, base: dict, chat: bool) -> web.Response:
    tok = run.model.tokenizer
    choices, thought_tokens = [], 0
    whole = await run.whole()
    for i, c in enumerate(whole):
        thought, content, calls = c.parts  # the thinking apart; calls and JSON are read from the answer
        thought_tokens += len(tok.encode(thought)) if thought else 0
        choice = {"index": i, "finish_reason": c.last.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": content}
            if thought:
                choice["message"]["reasoning_content"] = thought
            if calls:
                choice["message"]["tool_calls"] = calls
                choice["finish_reason"] = "tool_calls"
            choice["logprobs"] = {"content": chat_logprobs(tok, c.token_ids, c.logprobs)} if c.logprobs else None
        else:
            lp = completion_logprobs(tok, c.token_ids, c.logprobs) if c.logprobs else None
            choice.update(text=content, logprobs=lp)
        choices.append(choice)
    metrics = whole[0].last.metrics
    return web.json_response(
        {
            **base,
            "object": "chat.completion" if chat else "text_completion",
            "choices": choices,
            "usage": usage(metrics, run.prompt_tokens, sum(len(c.token_ids) for c in whole), thought_tokens),
            "minibatch": timings(metrics),
        }
    )


async def stream_response(request, run: Running, base: dict, chat: bool, include_usage: bool):
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": base["id"]}
    )
    await resp.prepare(request)
    tok = run.model.tokenizer
    obj = "chat.completion.chunk" if chat else "text_completion"
    n = len(run.streams)

    async def send(payload: dict) -> None:
        await resp.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")

    offsets = [0] * n  # completions' text_offset runs across chunks

    def chunk(i: int, delta_text: str | None, finish: str | None, role: bool = False, out=None, delta=None) -> dict:
        lp = None
        if out is not None and out.logprobs is not None and out.token_ids:
            if chat:
                lp = {"content": chat_logprobs(tok, out.token_ids, out.logprobs)}
            else:
                lp = completion_logprobs(tok, out.token_ids, out.logprobs, offsets[i])
                offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
        if chat:
            if delta is None:
                delta = (
                    {"role": "assistant", "content": ""}
                    if role
                    else ({} if delta_text is None else {"content": delta_text})
                )
            choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": i, "text": delta_text or "", "logprobs": lp, "finish_reason": finish}
        return {**base, "object": obj, "choices": [choice]}

    if chat:
        for i in range(n):
            await send(chunk(i, None, None, role=True))
    count, metrics = 0, None
    try:
        async with run.limit():
            async for i, out, (thought, text, found) in run.deltas():
                count += len(out.token_ids)
                if out.error:
                    await send(ApiError(500, out.error, None, "engine_error", "server_error").body())
                    break
                carries = out.logprobs is not None and bool(out.token_ids)
                finish = out.finish_reason
                # the reasoning streams apart, before the answer; a tool call is held back and sent whole at the end
                if thought and chat:
                    await send(chunk(i, None, None, delta={"reasoning_content": thought}))
                if text or (carries and not out.finished):
                    await send(chunk(i, text, None, out=out))
                if found:
                    calls = [{"index": k, **c} for k, c in enumerate(found)]
                    await send(chunk(i, None, None, delta={"tool_calls": calls}))
                    finish = "tool_calls"
                if out.finished:
                    final = chunk(i, None, finish, out=None if text else out)
                    final["minibatch"] = timings(out.metrics)
                    await send(final)
                    metrics = metrics or out.metrics
        if include_usage and metrics is not None:
            thought_tokens = sum(len(tok.encode(a.thought)) for a in run.answers if a.thought)
            total = usage(metrics, run.prompt_tokens, count, thought_tokens)
            await send({**base, "object": obj, "choices": [], "usage": total})
    except ApiError as exc:  # the time limit, mid-stream: its error is the last event
        await send(exc.body())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)

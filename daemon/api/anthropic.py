"""Anthropic's Messages API on the same listeners, for the clients that speak it (the `anthropic` SDKs,
Claude Code and other agents): `POST /v1/messages` and `POST /v1/messages/count_tokens`.

Here: how a request's system prompt and content blocks become the chat template's messages (tool_use blocks
an assistant's tool calls, tool_result blocks tool messages, thinking blocks its reasoning) and its tools
the pipeline's tool specs and constraint; its shapes are anthropic_bodies.py's. Answers are `message`
objects with content blocks and Anthropic's stop reasons; a stream is Anthropic's event sequence; errors are
`{"type": "error", "error": {"type", "message"}}` naming the field. The key may come as `x-api-key`
(guard.py) and `anthropic-version` is accepted and not checked. Unknown top-level fields are ignored (newer
clients send beta fields); the known ones are validated.
"""

from __future__ import annotations

import json
import time
import uuid

from aiohttp import web

from ..generation import pipeline, prompt
from ..generation.images import ImageInput, image_part
from ..generation.pipeline import Running
from ..generation.spec import Constraint, Generation, Reasoning
from ..protocol import ApiError
from ..state import STATE, off_loop, read_body
from .anthropic_bodies import (
    API_DEFAULTS,
    NAMES,
    CountTokensRequest,
    ImageBlock,
    MediaBlock,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
)

PATHS = ("/v1/messages", "/v1/messages/count_tokens")
# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


# -- requests into the core's terms ---------------------------------------------------------------------
def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def template_messages(body: CountTokensRequest) -> list[dict]:
    """The conversation as the chat template reads it (the OpenAI API's form, messages.py)."""
    out: list[dict] = []
    if body.system:
        out.append({"role": "system", "content": _text(body.system)})
    called: set[str] = set()  # the tool_use ids seen so far: a tool_result answers one of them
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text, calls, thoughts = [], [], []
        for j, b in enumerate(m.content):
            where = f"messages.{i}.content.{j}"
            if isinstance(b, MediaBlock):
                raise ApiError(400, f"{where}: {b.type} blocks are not supported", where, "unsupported")
            if isinstance(b, ImageBlock):
                if m.role != "user":
                    raise ApiError(400, f"{where}: image blocks belong to user messages", where)
                text.append(image_part(_image(b, where)))
            elif isinstance(b, TextBlock):
                text.append(b.text)
            elif isinstance(b, ThinkingBlock):
                if m.role != "assistant":
                    raise ApiError(400, f"{where}: thinking blocks belong to assistant messages", where)
                thoughts.append(b.thinking)
            elif isinstance(b, RedactedThinkingBlock):
                continue  # its thoughts are not readable: nothing to show the template
            elif isinstance(b, ToolUseBlock):
                if m.role != "assistant":
                    raise ApiError(400, f"{where}: tool_use blocks belong to assistant messages", where)
                calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}})
                called.add(b.id)
            else:  # a tool result: the tool's message, in order
                if m.role != "user":
                    raise ApiError(400, f"{where}: tool_result blocks belong to user messages", where)
                if b.tool_use_id not in called:
                    raise ApiError(
                        400,
                        f"{where}.tool_use_id: no tool_use block with id {b.tool_use_id!r} comes before it",
                        f"{where}.tool_use_id",
                        "invalid_value",
                    )
                if text:
                    out.append({"role": "user", "content": _content(text)})
                    text = []
                result = _text(b.content)
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": b.tool_use_id,
                        "content": f"Error: {result}" if b.is_error else result,
                    }
                )
        if m.role == "assistant":
            msg: dict = {"role": "assistant", "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            if thoughts:
                msg["reasoning_content"] = "".join(thoughts)
            out.append(msg)
        elif text:
            out.append({"role": "user", "content": _content(text)})
    return out


def _content(parts: list[str | dict]) -> str | list[dict]:
    """A message's text, or, with images among it, its parts in order (the pipeline's form)."""
    if all(isinstance(p, str) for p in parts):
        return "".join(parts)  # type: ignore[arg-type]
    return [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]


def _image(block: ImageBlock, where: str) -> ImageInput:
    source = block.source
    if source.type != "base64":
        msg = "the daemon fetches nothing and keeps no files: send the image as base64 data"
        raise ApiError(400, f"{where}.source.type: {msg}", f"{where}.source.type", "invalid_image")
    if source.data is None:
        raise ApiError(400, f"{where}.source.data: required with a base64 source", f"{where}.source.data")
    return ImageInput(f"{where}.source.data", b64=source.data)


def tool_specs(body: CountTokensRequest) -> list[dict] | None:
    """The tools as the template and the grammar take them; none when tool_choice is none."""
    choice = body.tool_choice
    if not body.tools or (choice is not None and choice.type == "none"):
        if choice is not None and choice.type in ("any", "tool"):
            raise ApiError(400, "tool_choice: a call is required but the request offers no tools", "tool_choice")
        return None
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                **({"description": t.description} if t.description else {}),
                "parameters": t.input_schema,
            },
        }
        for t in body.tools
    ]


def forced(body: MessagesRequest, specs: list[dict] | None) -> tuple[list[dict], str | None] | None:
    """(the functions, the one named or None for any) when tool_choice requires a call."""
    choice = body.tool_choice
    if specs is None or choice is None or choice.type in ("auto", "none"):
        return None
    functions = [s["function"] for s in specs]
    if choice.type == "any":
        return functions, None
    if choice.name is None:
        raise ApiError(400, "tool_choice.name: required when type is tool", "tool_choice.name", "missing")
    if choice.name not in {f["name"] for f in functions}:
        raise ApiError(400, f"tool_choice.name: no tool named {choice.name!r} in tools", "tool_choice.name")
    return functions, choice.name


def generation(body: CountTokensRequest) -> Generation:
    """A Messages (or count_tokens) body in the pipeline's terms. A thinking model: with `thinking` enabled its
    thoughts come back as thinking blocks; without it, a template that has the switch renders a prompt that
    does not think (Anthropic's default), else the thoughts still come back apart."""
    specs = tool_specs(body)
    enabled = body.thinking is not None and body.thinking.type == "enabled"
    gen = Generation(
        request_id=f"msg_{uuid.uuid4().hex[:24]}",
        model=body.model,
        prompt_field="messages",
        messages=template_messages(body),
        tools=specs,
        reasoning=Reasoning(off=not enabled, apart=True, budget=body.thinking.budget_tokens if enabled else None),
        api_defaults=API_DEFAULTS,
        names=NAMES,
    )
    if not isinstance(body, MessagesRequest):
        return gen
    thinking = body.thinking
    if thinking is not None and thinking.budget_tokens is not None and thinking.budget_tokens >= body.max_tokens:
        raise ApiError(
            400,
            f"thinking.budget_tokens: must be less than max_tokens ({body.max_tokens}), got "
            f"{thinking.budget_tokens}: the thinking counts against max_tokens",
            "thinking.budget_tokens",
            "invalid_value",
        )
    gen.sampling = body.sampling()
    must = forced(body, specs)
    fmt = body.output_config.format if body.output_config else None
    if fmt is not None and must is not None:
        raise ApiError(
            400, "output_config.format: cannot be combined with a required tool call", "output_config.format"
        )
    if must is not None:
        gen.constraint = Constraint("tools", call=must)
    elif fmt is not None:
        gen.constraint = Constraint("output_config.format.schema", fmt=fmt.schema_)
    return gen


# -- answers in Anthropic's shapes -----------------------------------------------------------------------
def error_body(exc: ApiError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(exc.status, "api_error"), "message": exc.message}}


def owns(request: web.Request) -> bool:
    """Whether a request is one of Anthropic's (its errors then take Anthropic's shape)."""
    return request.path in PATHS


def stop_reason(out, matched: str | None, calls: list) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a finished output."""
    if calls:
        return "tool_use", None
    if out.finish_reason == "length":
        return "max_tokens", None
    return ("stop_sequence", matched) if matched else ("end_turn", None)


def matched_stop(model, out, token_ids: list[int], text: str, stops: list[str]) -> str | None:
    """The stop sequence that ended the output, if one did: the earliest one in the decoded tokens past the
    output's text (`text`: all of it, thoughts and calls too; the engine leaves the stop string out)."""
    if not stops or out.finish_reason != "stop":
        return None
    tail = model.tokenizer.decode(token_ids)[len(text) :]
    found = [(tail.find(s), s) for s in stops if s in tail]
    return min(found)[1] if found else None


def content_blocks(text: str, calls: list[dict], thought: str = "") -> list[dict]:
    blocks: list[dict] = [{"type": "thinking", "thinking": thought, "signature": ""}] if thought else []
    blocks += [{"type": "text", "text": text}] if text or not calls else []
    for c in calls:
        blocks.append({"type": "tool_use", "id": tool_use_id(c), "name": c["function"]["name"], "input": _input(c)})
    return blocks


def tool_use_id(call: dict) -> str:
    return "toolu_" + call["id"].removeprefix("call_")


def _input(call: dict) -> dict:
    try:
        value = json.loads(call["function"]["arguments"])
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


def usage(prompt_tokens: int, output_tokens: int, metrics) -> dict:
    cached = metrics.cached_prompt_tokens if metrics else 0
    return {
        "input_tokens": prompt_tokens - cached,  # Anthropic counts cache reads apart from the input
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


async def messages(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_body(request, state, MessagesRequest)
    async with pipeline.generate(state, await off_loop(generation, body), request) as run:
        if body.stream:
            return await stream(request, run, body)
        return await whole(run, body)


async def whole(run: Running, body: MessagesRequest) -> web.Response:
    (c,) = await run.whole()
    thought, content, calls = c.parts
    matched = matched_stop(run.model, c.last, c.token_ids, c.text, body.stop_sequences or [])
    reason, seq = stop_reason(c.last, matched, calls)
    return web.json_response(
        {
            "id": run.gen.request_id,
            "type": "message",
            "role": "assistant",
            "model": run.name,
            "content": content_blocks(content or "", calls, thought),
            "stop_reason": reason,
            "stop_sequence": seq,
            "usage": usage(run.prompt_tokens, len(c.token_ids), c.last.metrics),
        }
    )


async def stream(request, run: Running, body: MessagesRequest):
    model, rid, prompt_tokens = run.model, run.gen.request_id, run.prompt_tokens
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": rid}
    )
    await resp.prepare(request)

    async def send(kind: str, payload: dict) -> None:
        data = json.dumps({"type": kind, **payload}, separators=(",", ":"))
        await resp.write(f"event: {kind}\ndata: {data}\n\n".encode())

    message = {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model.name,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {**usage(prompt_tokens, 0, None), "output_tokens": 0},
    }
    await send("message_start", {"message": message})
    await send("ping", {})
    index, text_open, token_ids, output = 0, False, [], []
    thinking_open = False
    last_ping = time.monotonic()
    try:
        async with run.limit():
            async for _, out, (thought, piece, calls) in run.deltas():
                token_ids += out.token_ids
                if out.error:
                    await send("error", {"error": {"type": "api_error", "message": out.error}})
                    return resp
                output.append(out.text)  # the whole output (thoughts and calls too): where a stop sequence cut it
                if thought:
                    if not thinking_open:
                        block = {"type": "thinking", "thinking": "", "signature": ""}
                        await send("content_block_start", {"index": index, "content_block": block})
                        thinking_open = True
                    delta = {"type": "thinking_delta", "thinking": thought}
                    await send("content_block_delta", {"index": index, "delta": delta})
                if thinking_open and (piece or calls or out.finished):  # the thinking is over: its block closes
                    await send(
                        "content_block_delta", {"index": index, "delta": {"type": "signature_delta", "signature": ""}}
                    )
                    await send("content_block_stop", {"index": index})
                    index, thinking_open = index + 1, False
                if piece:
                    if not text_open:
                        await send(
                            "content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}}
                        )
                        text_open = True
                    await send("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": piece}})
                if time.monotonic() - last_ping > 10:
                    await send("ping", {})
                    last_ping = time.monotonic()
                if not out.finished:
                    continue
                if text_open:
                    await send("content_block_stop", {"index": index})
                    index += 1
                for c in calls:
                    block = {"type": "tool_use", "id": tool_use_id(c), "name": c["function"]["name"], "input": {}}
                    await send("content_block_start", {"index": index, "content_block": block})
                    partial = json.dumps(_input(c), ensure_ascii=False)
                    await send(
                        "content_block_delta",
                        {"index": index, "delta": {"type": "input_json_delta", "partial_json": partial}},
                    )
                    await send("content_block_stop", {"index": index})
                    index += 1
                matched = matched_stop(model, out, token_ids, "".join(output), body.stop_sequences or [])
                reason, seq = stop_reason(out, matched, calls)
                await send(
                    "message_delta",
                    {
                        "delta": {"stop_reason": reason, "stop_sequence": seq},
                        "usage": {"output_tokens": len(token_ids)},
                    },
                )
                await send("message_stop", {})
    except ApiError as exc:  # the time limit, mid-stream: its error is the last event
        await send("error", error_body(exc)["error"])
    await resp.write_eof()
    return resp


async def count_tokens(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request, state, CountTokensRequest)
    gen = await off_loop(generation, body)
    async with state.lease(body.model) as model:
        rendered = await prompt.render(state, model, gen, encode=False)  # (an image's places need no tower)
    return web.json_response({"input_tokens": len(rendered.prompts[0])})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)

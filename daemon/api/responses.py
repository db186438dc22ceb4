"""OpenAI's Responses API on the same listeners, for the clients that speak it (the openai SDK's
`responses.create`, Codex and other agents): `POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`.

Here: how `instructions` and `input` (a string, or message / function_call / function_call_output items)
become the chat template's messages, and `tools`, `tool_choice` and `text.format` the pipeline's tools and
constraint; how its events and answers are encoded. The body's shapes are responses_bodies.py's, the store
(`previous_response_id`, GET, DELETE) response_store.py's. Errors are the OpenAI shape.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from aiohttp import web
from pydantic import BaseModel

from ..generation import pipeline, prompt
from ..generation.images import ImageInput, check_url, image_part
from ..generation.pipeline import Running
from ..generation.spec import Constraint, Generation, Reasoning
from ..protocol import ApiError
from ..state import STATE, off_loop, read_body
from .response_store import STORE, ResponseStore, response_id
from .responses_bodies import (
    API_DEFAULTS,
    NAMES,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputImage,
    InputText,
    MessageItem,
    ResponsesRequest,
)


# -- requests into the core's terms ---------------------------------------------------------------------
def _content(content, at: str) -> str | list[dict]:
    """A message item's text, or, with images among it, its parts in order (the pipeline's form)."""
    if isinstance(content, str):
        return content
    if not any(isinstance(p, InputImage) for p in content):
        return "".join(p.text for p in content)
    return [
        {"type": "text", "text": p.text} if isinstance(p, InputText) else image_part(_image(p, f"{at}.content.{j}"))
        for j, p in enumerate(content)
    ]


def _image(part: InputImage, where: str) -> ImageInput:
    if part.image_url is None:
        msg = "the daemon keeps no files: send image_url, a base64 data: URL"
        raise ApiError(
            400, f"{where}.file_id: {msg}" if part.file_id else f"{where}.image_url: required", f"{where}.image_url"
        )
    return check_url(part.image_url, f"{where}.image_url")


def conversation(body: ResponsesRequest, earlier: list[dict]) -> list[dict]:
    """The chat template's messages: the stored conversation, the instructions, then this input."""
    out = list(earlier)
    if body.instructions:
        out = [m for m in out if m["role"] != "system"]
        out.insert(0, {"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*out, {"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _content(item.content, f"input.{i}")})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": _args(item)}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1] = {**out[-1], "tool_calls": [*out[-1]["tool_calls"], call]}  # not the stored one's list
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return out


def _args(item: FunctionCallItem):
    try:
        return json.loads(item.arguments)
    except ValueError:
        return item.arguments


def tool_specs(body: ResponsesRequest) -> list[dict] | None:
    if not body.tools or body.tool_choice == "none":
        if body.tool_choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice: a call is required but the request offers no tools", "tool_choice")
        return None
    return [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})} for t in body.tools]


def forced(body: ResponsesRequest, specs: list[dict] | None) -> tuple[list[dict], str | None] | None:
    choice = body.tool_choice
    if specs is None or choice in (None, "auto", "none"):
        return None
    functions = [s["function"] for s in specs]
    if choice == "required":
        return functions, None
    if choice.name not in {f["name"] for f in functions}:
        raise ApiError(400, f"tool_choice.name: no tool named {choice.name!r} in tools", "tool_choice.name")
    return functions, choice.name


def constraint(body: ResponsesRequest, specs) -> Constraint | None:
    must = forced(body, specs)
    fmt = body.text.format if body.text else None
    if must is not None:
        if fmt is not None and fmt.type != "text":
            raise ApiError(400, "text.format: cannot be combined with a required tool call", "text.format")
        return Constraint("tools", call=must)
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint("text.format", fmt="json")
    if fmt.schema_ is None:
        raise ApiError(400, "text.format.schema: required when type is json_schema", "text.format.schema", "missing")
    return Constraint("text.format.schema", fmt=fmt.schema_)


def generation(body: ResponsesRequest, earlier: list[dict]) -> Generation:
    """A Responses body (after the stored conversation it continues) in the pipeline's terms."""
    specs = tool_specs(body)
    return Generation(
        request_id=f"respreq-{uuid.uuid4().hex}",  # the engine's id: not the response's, which addresses it
        model=body.model,
        prompt_field="input",
        messages=conversation(body, earlier),
        tools=specs,
        sampling=body.sampling(),
        api_defaults=API_DEFAULTS,
        names=NAMES,
        constraint=constraint(body, specs),
        reasoning=Reasoning.asked(body.reasoning.effort if body.reasoning else None),
    )


# -- answers in the Responses shapes ---------------------------------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def reasoning_item(rs_id: str, thought: str, status: str = "completed") -> dict:
    """A thinking model's thoughts as the Responses API gives them: a reasoning item of reasoning_text."""
    content = [{"type": "reasoning_text", "text": thought}] if status == "completed" else []
    return {"type": "reasoning", "id": rs_id, "status": status, "summary": [], "content": content}


def output_items(text: str, calls: list[dict], thought: str = "") -> list[dict]:
    items = [reasoning_item(_id("rs"), thought)] if thought else []
    if text or not calls:
        items.append(
            {
                "type": "message",
                "id": _id("msg"),
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        )
    for c in calls:
        items.append(
            {
                "type": "function_call",
                "id": _id("fc"),
                "call_id": c["id"],
                "name": c["function"]["name"],
                "arguments": c["function"]["arguments"],
                "status": "completed",
            }
        )
    return items


def response_object(
    rid: str, model: str, body: ResponsesRequest, status: str, output: list, usage: dict | None
) -> dict:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "model": model,
        "output": output,
        "instructions": body.instructions,
        "previous_response_id": body.previous_response_id,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "tool_choice": body.tool_choice.model_dump()
        if isinstance(body.tool_choice, BaseModel)
        else body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)}
        if body.text and body.text.format
        else {"format": {"type": "text"}},
        "store": body.store,
        "metadata": body.metadata or {},
        "usage": usage,
    }


def usage_of(model, prompt_tokens: int, output_tokens: int, metrics, thought: str = "") -> dict:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": metrics.cached_prompt_tokens if metrics else 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": len(model.tokenizer.encode(thought)) if thought else 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


def remember(
    store: ResponseStore, response: dict, messages: list[dict], text: str, calls: list[dict], thought: str, owner: str
) -> None:
    """The conversation a later previous_response_id continues: this one's messages and its answer."""
    answer: dict = {"role": "assistant", "content": text}
    if thought:
        answer["reasoning_content"] = thought
    if calls:
        answer["tool_calls"] = [
            {**c, "function": {"name": c["function"]["name"], "arguments": _parsed(c["function"]["arguments"])}}
            for c in calls
        ]
    store.put(response, [*messages, answer], owner)


def _parsed(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


async def create(request: web.Request) -> web.StreamResponse:
    state, store = request.app[STATE], request.app[STORE]
    body = await read_body(request, state, ResponsesRequest)
    owner = state.identity(request)
    earlier = (
        store.get(body.previous_response_id, owner, "previous_response_id")[1] if body.previous_response_id else []
    )
    async with pipeline.generate(state, await off_loop(generation, body, earlier), request) as run:
        answer = Answer(store, run, body, owner, response_id(state.replica_tag))
        return await (stream(request, answer) if body.stream else whole(answer))


@dataclass(slots=True)
class Answer:
    """What a response is answered with, beside the engine's outputs."""

    store: ResponseStore
    run: Running
    body: ResponsesRequest
    owner: str  # who asked (guard.IDENTITY): the stored response is theirs
    rid: str  # the response's id, apart from the engine's request id (which the engine endpoints show)

    def finish(self, status: str, items: list[dict], n: int, metrics, text: str, calls, thought: str) -> dict:
        run = self.run
        usage = usage_of(run.model, run.prompt_tokens, n, metrics, thought)
        response = response_object(self.rid, run.name, self.body, status, items, usage)
        if self.body.store:
            remember(self.store, response, run.gen.messages or [], text, calls, thought, self.owner)
        return response


def _status(finish_reason: str | None, calls: list) -> str:
    return "incomplete" if finish_reason == "length" and not calls else "completed"


async def whole(a: Answer) -> web.Response:
    (c,) = await a.run.whole()
    thought, content, calls = c.parts
    content = content or ""
    items = output_items(content, calls, thought)
    status = _status(c.last.finish_reason, calls)
    return web.json_response(a.finish(status, items, len(c.token_ids), c.last.metrics, content, calls, thought))


async def stream(request, a: Answer):
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": a.rid}
    )
    await resp.prepare(request)
    seq = 0

    async def send(kind: str, payload: dict) -> None:
        nonlocal seq
        data = json.dumps({"type": kind, "sequence_number": seq, **payload}, separators=(",", ":"))
        seq += 1
        await resp.write(f"event: {kind}\ndata: {data}\n\n".encode())

    started = response_object(a.rid, a.run.name, a.body, "in_progress", [], None)
    await send("response.created", {"response": started})
    await send("response.in_progress", {"response": started})
    items: list[dict] = []  # the finished output items, in order
    msg_id, rs_id, sent, thoughts, n = _id("msg"), _id("rs"), [], [], 0
    opened = thinking_open = False

    def where(item_id: str) -> dict:
        return {"item_id": item_id, "output_index": len(items), "content_index": 0}

    async def open_item(item: dict, part: dict) -> None:
        await send("response.output_item.added", {"output_index": len(items), "item": item})
        await send("response.content_part.added", {**where(item["id"]), "part": part})

    async def close_reasoning() -> None:
        thought = "".join(thoughts)
        await send("response.reasoning_text.done", {**where(rs_id), "text": thought})
        item = reasoning_item(rs_id, thought)
        await send("response.content_part.done", {**where(rs_id), "part": item["content"][0]})
        await send("response.output_item.done", {"output_index": len(items), "item": item})
        items.append(item)

    async def open_message() -> None:
        item = {"type": "message", "id": msg_id, "status": "in_progress", "role": "assistant", "content": []}
        await open_item(item, {"type": "output_text", "text": "", "annotations": []})

    try:
        async with a.run.limit():
            async for _, out, (thought, piece, calls) in a.run.deltas():
                n += len(out.token_ids)
                if out.error:
                    failed = {**started, "status": "failed", "error": {"code": "server_error", "message": out.error}}
                    await send("response.failed", {"response": failed})
                    return resp
                if thought:
                    if not thinking_open:
                        await open_item(
                            reasoning_item(rs_id, "", "in_progress"), {"type": "reasoning_text", "text": ""}
                        )
                        thinking_open = True
                    thoughts.append(thought)
                    await send("response.reasoning_text.delta", {**where(rs_id), "delta": thought})
                if thinking_open and (piece or calls or out.finished):
                    await close_reasoning()
                    thinking_open = False
                if piece:
                    if not opened:
                        await open_message()
                        opened = True
                    sent.append(piece)
                    await send("response.output_text.delta", {**where(msg_id), "delta": piece, "logprobs": []})
                if not out.finished:
                    continue
                text = "".join(sent)
                if opened or not calls:
                    if not opened:
                        await open_message()
                    part = {"type": "output_text", "text": text, "annotations": []}
                    await send("response.output_text.done", {**where(msg_id), "text": text, "logprobs": []})
                    await send("response.content_part.done", {**where(msg_id), "part": part})
                    message = {"type": "message", "id": msg_id, "status": "completed", "role": "assistant"}
                    await send(
                        "response.output_item.done",
                        {"output_index": len(items), "item": {**message, "content": [part]}},
                    )
                    items.append({**message, "content": [part]})
                for c in calls:
                    item = output_items("", [c])[-1]
                    index = len(items)
                    await send(
                        "response.output_item.added",
                        {"output_index": index, "item": {**item, "arguments": "", "status": "in_progress"}},
                    )
                    await send(
                        "response.function_call_arguments.delta",
                        {"item_id": item["id"], "output_index": index, "delta": item["arguments"]},
                    )
                    await send(
                        "response.function_call_arguments.done",
                        {"item_id": item["id"], "output_index": index, "arguments": item["arguments"]},
                    )
                    await send("response.output_item.done", {"output_index": index, "item": item})
                    items.append(item)
                status = _status(out.finish_reason, calls)
                done = a.finish(status, items, n, out.metrics, text, calls, "".join(thoughts))
                await send("response.completed" if status == "completed" else "response.incomplete", {"response": done})
    except ApiError as exc:  # the time limit, mid-stream: the response fails with its error
        failed = {**started, "status": "failed", "error": {"code": exc.code, "message": exc.message}}
        await send("response.failed", {"response": failed})
    await resp.write_eof()
    return resp


async def get_response(request: web.Request) -> web.Response:
    owner = request.app[STATE].identity(request)
    return web.json_response(request.app[STORE].get(request.match_info["response_id"], owner)[0])


async def delete_response(request: web.Request) -> web.Response:
    rid = request.match_info["response_id"]
    request.app[STORE].delete(rid, request.app[STATE].identity(request))
    return web.json_response({"id": rid, "object": "response.deleted", "deleted": True})


async def input_tokens(request: web.Request) -> web.Response:
    """POST /v1/responses/input_tokens: the prompt tokens the same body's response would compute (its stored
    conversation, instructions and tools rendered by the template), without running it."""
    state, store = request.app[STATE], request.app[STORE]
    body = await read_body(request, state, ResponsesRequest)
    earlier = (
        store.get(body.previous_response_id, state.identity(request), "previous_response_id")[1]
        if body.previous_response_id
        else []
    )
    gen = await off_loop(generation, body, earlier)
    async with state.lease(body.model) as model:
        rendered = await prompt.render(state, model, gen, encode=False)  # (an image's places need no tower)
    return web.json_response({"object": "response.input_tokens", "input_tokens": len(rendered.prompts[0])})


def add_routes(app: web.Application) -> None:
    app[STORE] = ResponseStore()
    app.router.add_post("/v1/responses", create)
    app.router.add_post("/v1/responses/input_tokens", input_tokens)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)

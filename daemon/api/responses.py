"""OpenAI's Responses API on the same listeners, for the clients that speak it (the openai SDK's
`responses.create`, Codex and other agents): `POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`.

Only the shapes live here: `instructions` and `input` (a string, or message / function_call /
function_call_output items) become the chat template's messages; `tools`, `tool_choice` and
`text.format` the same tool specs and grammars the Chat Completions API uses (tools.py, grammars.py);
the request is admitted, sampled and streamed by the same core (state.submit, the model's engine).
`previous_response_id` continues a stored response: its input and output come before the new input.
Stored responses (`store`, default true) are kept in memory, at most STORE_MAX of them for at most
STORE_TTL_S seconds each; an unknown or expired id is a 404 that says so. Errors are the OpenAI shape.
"""

from __future__ import annotations

import copy
import hashlib
import hmac
import json
import re
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictStr, Tag

from ..generation import pipeline
from ..generation.pipeline import Constraint, Generation, Running
from ..protocol import ApiError, Float, Int
from ..state import STATE, off_loop, read_body
from .messages import FUNCTION_NAME, MAX_TOOLS

STORE_MAX = 512  # responses kept for previous_response_id and GET, the oldest evicted first
STORE_MAX_BYTES = 64 * 2**20  # and their JSON together at most this, the oldest evicted first
STORE_TTL_S = 3600.0
# OpenAI's limits on metadata: 16 pairs, keys up to 64 characters, values up to 512
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512
ID_PATTERN = "^resp_[0-9a-f]{24}$"  # what response_id makes


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class InputText(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: StrictStr
    annotations: list[Any] | None = None


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: StrictStr | list[InputText]
    id: StrictStr | None = None
    status: StrictStr | None = None


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: StrictStr = Field(min_length=1, max_length=256)
    name: StrictStr = Field(pattern=FUNCTION_NAME)
    arguments: StrictStr
    id: StrictStr | None = None
    status: StrictStr | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: StrictStr = Field(min_length=1, max_length=256)
    output: StrictStr
    id: StrictStr | None = None
    status: StrictStr | None = None


class ReasoningItem(BaseModel):
    """An earlier reasoning item sent back: nothing of it reaches the template."""

    model_config = ConfigDict(extra="allow")
    type: Literal["reasoning"]


def _item_kind(value) -> str:
    return value.get("type", "message") if isinstance(value, dict) else "message"


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


class FunctionTool(_Body):
    type: Literal["function"]
    name: StrictStr = Field(pattern=FUNCTION_NAME)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: StrictStr


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


class TextOptions(_Body):
    format: TextFormat | None = None
    verbosity: StrictStr | None = None


class Reasoning(_Body):
    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: StrictStr | None = None


class ResponsesRequest(_Body):
    model: StrictStr | None = None
    input: Annotated[
        Annotated[StrictStr, Tag("text")] | Annotated[list[Item], Tag("items")],
        Discriminator(lambda v: "text" if isinstance(v, str) else "items"),
        Field(min_length=1),
    ]
    instructions: StrictStr | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    text: TextOptions | None = None
    max_output_tokens: Int | None = Field(default=None, ge=1)
    temperature: Float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)
    seed: Int | None = Field(default=None, ge=0, le=2**63 - 1)  # an extension: the same seed, the same tokens
    # accepted; the effort is the template's business (ignored here). A thinking model's thoughts come back as
    # a reasoning item before the answer (with --reasoning-format auto)
    reasoning: Reasoning | None = None
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: StrictStr | None = None
    metadata: (
        dict[
            Annotated[StrictStr, Field(max_length=METADATA_KEY)],
            Annotated[StrictStr, Field(max_length=METADATA_VALUE)],
        ]
        | None
    ) = Field(default=None, max_length=METADATA_PAIRS)
    parallel_tool_calls: StrictBool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: StrictStr | None = None

    def sampling(self) -> dict:
        """What the request set, in SamplingParams' names."""
        given = {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_output_tokens}
        given["seed"] = self.seed
        return {k: v for k, v in given.items() if v is not None}


# a SamplingParams field -> the Responses API's name for it, where they differ
NAMES = {"max_tokens": "max_output_tokens"}
# the API's defaults for what neither the request nor the model sets
API_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}


# -- the store -------------------------------------------------------------------------------------------
class ResponseStore:
    """Recent responses by id, each with its owner (who made it: a key's name, or the socket's user) and what
    its conversation was (for previous_response_id). Bounded by count, by bytes and by age; another owner's
    response is answered exactly as an unknown id is."""

    def __init__(self, max_items: int = STORE_MAX, ttl: float = STORE_TTL_S, max_bytes: int = STORE_MAX_BYTES):
        self.max_items, self.ttl, self.max_bytes = max_items, ttl, max_bytes
        self._items: OrderedDict[str, tuple[float, str, dict, list[dict], int]] = OrderedDict()
        self.bytes = 0  # the stored responses' and conversations' JSON
        self.evicted = 0

    def put(self, response: dict, conversation: list[dict], owner: str) -> None:
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        if size > self.max_bytes:
            self.evicted += 1
            return  # more than the whole store holds: answered, not kept
        self._drop(response["id"])
        self._items[response["id"]] = (time.monotonic(), owner, response, conversation, size)
        self.bytes += size
        while len(self._items) > self.max_items or self.bytes > self.max_bytes:
            self._drop(next(iter(self._items)))
            self.evicted += 1

    def _drop(self, rid: str) -> None:
        entry = self._items.pop(rid, None)
        if entry is not None:
            self.bytes -= entry[4]

    def get(self, rid: str, owner: str, param: str = "response_id") -> tuple[dict, list[dict]]:
        """The response and its conversation (a copy: a continuation never changes what is stored)."""
        if not re.fullmatch(ID_PATTERN, rid):
            raise ApiError(404, f"{param}: {rid[:80]!r} is not a response id (resp_ and 24 hex digits)", param)
        entry = self._items.get(rid)
        if entry is not None and time.monotonic() - entry[0] > self.ttl:
            self._drop(rid)
            entry = None
        if entry is None or not hmac.compare_digest(entry[1], owner):
            raise ApiError(
                404,
                f"{param}: no stored response {rid!r} (responses are kept {self.ttl / 60:g} minutes, "
                f"{self.max_items} and {self.max_bytes // 2**20} MiB at most, only with store: true, and "
                "only for the key that made them)",
                param,
                "response_not_found",
            )
        return entry[2], copy.deepcopy(entry[3])

    def delete(self, rid: str, owner: str) -> None:
        self.get(rid, owner)
        self._drop(rid)

    def prometheus(self) -> bytes:
        """What the store holds, and what it let go, in Prometheus' text format."""
        lines = [
            "# HELP minibatch_responses_stored Responses kept for GET and previous_response_id",
            "# TYPE minibatch_responses_stored gauge",
            f"minibatch_responses_stored {len(self._items)}",
            "# HELP minibatch_responses_stored_bytes Their JSON, and their conversations', together",
            "# TYPE minibatch_responses_stored_bytes gauge",
            f"minibatch_responses_stored_bytes {self.bytes}",
            "# HELP minibatch_responses_evicted_total Responses let go for room (count or bytes), or too large to keep",
            "# TYPE minibatch_responses_evicted_total counter",
            f"minibatch_responses_evicted_total {self.evicted}",
        ]
        return ("\n".join(lines) + "\n").encode()


STORE = web.AppKey("responses", ResponseStore)


# -- requests into the core's terms ---------------------------------------------------------------------
def _text(content) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def conversation(body: ResponsesRequest, earlier: list[dict]) -> list[dict]:
    """The chat template's messages: the stored conversation, the instructions, then this input."""
    out = list(earlier)
    if body.instructions:
        out = [m for m in out if m["role"] != "system"]
        out.insert(0, {"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*out, {"role": "user", "content": body.input}]
    for item in body.input:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _text(item.content)})
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
    )


# -- answers in the Responses shapes ---------------------------------------------------------------------
def response_id(tag: str | None) -> str:
    """A response's id: resp_ and 24 hex digits, the first 8 the replica's tag behind a cluster's ingress
    (which routes the response's later requests by it)."""
    return "resp_" + (tag or "") + uuid.uuid4().hex[: 24 - len(tag or "")]


def replica_tag(replica_id: str) -> str:
    """A replica's 8 hex digits in the ids of the responses it stores."""
    return hashlib.sha256(replica_id.encode()).hexdigest()[:8]


def tag_of(response_id: str) -> str | None:
    return response_id[5:13] if re.fullmatch(ID_PATTERN, response_id) else None


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


def response_object(rid: str, model, body: ResponsesRequest, status: str, output: list, usage: dict | None) -> dict:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "model": model.name,
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
    async with pipeline.generate(state, await off_loop(generation, body, earlier)) as run:
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
        response = response_object(self.rid, run.model, self.body, status, items, usage)
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

    started = response_object(a.rid, a.run.model, a.body, "in_progress", [], None)
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


def add_routes(app: web.Application) -> None:
    app[STORE] = ResponseStore()
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)

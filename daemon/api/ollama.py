"""Ollama's API on the same listeners, for the clients that speak it (the ollama libraries, oterm, Open WebUI...).

`POST /api/chat` and `POST /api/generate` stream newline-delimited JSON by
default (`"stream": false` for one object), with Ollama's counters and
durations (nanoseconds) on the last line; `GET /api/tags`, `POST /api/show`,
`GET /api/ps` and `GET /api/version` describe what is served. Errors are
Ollama's shape, `{"error": "..."}`, naming the field. Top-level fields and
options we do not use (num_ctx, num_gpu...) are accepted and
ignored, as Ollama does with options a model lacks; the ones we use are
validated. `model` names any model the daemon can serve (daemon/models/pool.py loads it on first use;
left out: the daemon's own), and `keep_alive` says how long it stays loaded after the request.
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from minibatch.engine.core.sampling_params import MAX_TOP_K
from minibatch.engine.text.fim import Infill

from ..generation import pipeline
from ..generation.images import ImageInput, image_part
from ..generation.pipeline import Running
from ..generation.spec import Constraint, Generation, Reasoning
from ..models.catalog import catalog
from ..models.loaded import iso, parse_keep_alive
from ..protocol import ApiError, Float, Int, parse_body
from ..state import STATE, off_loop, read_raw
from .messages import MAX_TOOLS, Tool
from .samplers import SAMPLER_FIELDS, given_samplers, sampler_fields
from .schemas import OllamaShowRequest

if TYPE_CHECKING:
    from minibatch.engine.text.tokenizer import TextTokenizer

VERSION = "0.6.0"  # the Ollama API version whose shapes these follow


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class Options(sampler_fields(_Lenient, "_OllamaSamplers")):
    temperature: Float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: Int | None = Field(default=None, ge=-1, le=MAX_TOP_K)
    min_p: Float | None = Field(default=None, ge=0.0, le=1.0)
    repeat_penalty: Float | None = Field(default=None, gt=0.0, le=2.0)
    presence_penalty: Float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Float | None = Field(default=None, ge=-2.0, le=2.0)
    seed: Int | None = Field(default=None, ge=0, le=2**63 - 1)
    num_predict: Int | None = Field(default=None, ge=-2)  # -1: until the context is full
    stop: list[StrictStr] | None = Field(default=None, max_length=16)
    speculative: StrictBool | None = None  # false: never verify draft tokens for this request


class OllamaFunctionCall(_Lenient):
    name: StrictStr
    arguments: dict[str, Any] = Field(default_factory=dict)


class OllamaToolCall(_Lenient):
    function: OllamaFunctionCall


class OllamaMessage(_Lenient):
    role: StrictStr = Field(pattern="^(system|user|assistant|tool)$")
    content: StrictStr = ""
    tool_calls: list[OllamaToolCall] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_name: StrictStr | None = None  # which function a tool message answers
    images: list[StrictStr] | None = None  # base64, each before the message's text

    def for_template(self, at: str) -> dict:
        out: dict = {"role": self.role, "content": with_images(self.content, self.images, f"{at}.images")}
        if self.tool_name is not None:
            out["name"] = self.tool_name
        if self.tool_calls:
            out["tool_calls"] = [
                {"type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in self.tool_calls
            ]
        return out


class _Request(_Lenient):
    model: StrictStr | None = None
    stream: StrictBool = True
    # how long the model stays loaded after this request: seconds or a duration ("5m"); 0 unloads it, -1 keeps it
    keep_alive: StrictStr | Int | Float | None = None
    # a thinking model: true, its reasoning apart in `thinking`; false, a prompt that does not think where the
    # template has the switch (enable_thinking); a level (gpt-oss's): apart, within that level's thinking budget
    # (generation/reasoning.py); unset: apart, as --reasoning-format says
    think: StrictBool | Literal["low", "medium", "high"] | None = None
    options: Options = Field(default_factory=Options)
    format: Literal["json", ""] | dict[str, Any] | None = None  # any JSON, or a JSON schema

    def sampling(self) -> dict:
        """The options the request set, in SamplingParams' names; -1 / -2 (until the context is full) and 0
        for num_predict are left to the daemon's default (what fits the context)."""
        o = self.options
        given = {k: getattr(o, name) for k, name in OPTION_NAMES.items() if getattr(o, name) is not None}
        if o.num_predict is not None and o.num_predict <= 0:
            del given["max_tokens"]
        if "stop" in given:
            given["stop"] = list(given["stop"])
        if o.speculative is not None:
            given["speculative"] = o.speculative
        return given | given_samplers(o)


# a SamplingParams field -> the option that sets it
OPTION_NAMES = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repeat_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
    "max_tokens": "num_predict",
    "stop": "stop",
}
# Ollama's documented defaults for what neither the request nor the model sets
API_DEFAULTS = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "min_p": 0.0, "repetition_penalty": 1.1}


class ChatBody(_Request):
    messages: list[OllamaMessage] = Field(default_factory=list, max_length=1000)  # none: only load (or unload)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)


class GenerateBody(_Request):
    prompt: StrictStr = ""
    images: list[StrictStr] | None = None  # base64, before the prompt's text
    # fill in the middle: the prompt is the code before the gap, this the code after it (a coder model's)
    suffix: StrictStr | None = None
    system: StrictStr | None = None
    raw: StrictBool = False


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def ns(seconds: float | None) -> int:
    return int((seconds or 0.0) * 1e9)


def final_counters(out, prompt_tokens: int, n: int, started: float) -> dict:
    m = out.metrics
    return {
        "done": True,
        "done_reason": {"stop": "stop", "length": "length"}.get(out.finish_reason, out.finish_reason),
        "total_duration": ns(time.perf_counter() - started),
        "load_duration": 0,
        "prompt_eval_count": prompt_tokens,
        "prompt_eval_duration": ns(m.prefill_time if m else 0),
        "eval_count": n,
        "eval_duration": ns(m.decode_time if m else 0),
    }


async def respond(request: web.Request, chat: bool):
    state = request.app[STATE]
    started = time.perf_counter()
    raw = await read_raw(request, state)
    body = await off_loop(parse_body, raw, ChatBody if chat else GenerateBody)
    if (not body.messages) if chat else (not body.prompt and body.suffix is None):
        return await load_only(request, state, body, chat, started)
    gen = generation(body, chat)
    gen.operator = state.is_operator(request)
    async with pipeline.generate(state, gen, request) as run:
        return await answer(request, run, body, chat, started)


async def load_only(request: web.Request, state, body, chat: bool, started: float) -> web.StreamResponse:
    """Ollama's empty request: load the model (the answer says done_reason "load"), or with keep_alive 0
    unload it ("unload"). A streaming one sees the loading status first, as Ollama's clients expect."""
    pool = state.check_serving()
    name = body.model or state.model_name
    unload = body.keep_alive is not None and parse_keep_alive(body.keep_alive) == 0
    head = {"model": name, "created_at": now_iso()}
    empty = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    if unload:
        m = pool.find(body.model)
        if m is not None and pool.operators_model(m) and not state.is_operator(request):
            raise ApiError(
                403,
                f"keep_alive: {m.name!r} was loaded by the daemon's operator (--model, --preload); only the "
                "operator's own requests (over the socket, without a key) unload it",
                "keep_alive",
                "operator_model",
                "permission_error",
            )
        if m is not None:
            m.keep_alive = 0.0
            m.touch(0.0)
            if not m.busy:
                await pool.unload(m, "keep_alive 0")
        return web.json_response({**head, **empty, "done": True, "done_reason": "unload"})
    resp = None
    if body.stream and not pool.loaded_or_loading(body.model):
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        await resp.write(json.dumps({**head, **empty, "done": False, "status": "loading"}).encode() + b"\n")
    try:
        keep = state.keep_alive_of(body.keep_alive, state.is_operator(request))
        if keep is not None:
            keep.taken = True  # a load is what the request asks for
        async with state.lease(body.model, keep) as m:
            final = {**head, "model": m.name, **empty, "done": True, "done_reason": "load"}
            final["load_duration"] = ns(time.perf_counter() - started)
    except ApiError as exc:
        if resp is None:
            raise
        await resp.write(json.dumps(error_body(exc)).encode() + b"\n")
        await resp.write_eof()
        return resp
    if resp is None:
        return web.json_response(final)
    await resp.write(json.dumps(final).encode() + b"\n")
    await resp.write_eof()
    return resp


def with_images(text: str, images: list[str] | None, field: str) -> str | list[dict]:
    """A message's text, or its images (base64, each named `field`.N) then its text, as the pipeline's parts."""
    if not images:
        return text
    return [
        *(image_part(ImageInput(f"{field}.{j}", b64=b)) for j, b in enumerate(images)),
        {"type": "text", "text": text},
    ]


def generation(body: ChatBody | GenerateBody, chat: bool) -> Generation:
    """An Ollama body in the pipeline's terms."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if chat and body.tools else None
    fill = None
    if chat:
        messages, prompts = [m.for_template(f"messages.{i}") for i, m in enumerate(body.messages)], None
    elif body.suffix is not None:
        if body.images:
            msg = "a fill in the middle takes no images"
            raise ApiError(400, f"images: {msg}", "images", "invalid_value")
        messages, prompts, fill = None, None, Infill(body.prompt, body.suffix)
    elif body.raw:
        if body.images:
            msg = "images go where the model's template puts them: send them without raw"
            raise ApiError(400, f"images: {msg}", "images", "invalid_value")
        messages, prompts = None, [body.prompt]
    else:
        system = [{"role": "system", "content": body.system}] if body.system else []
        user = {"role": "user", "content": with_images(body.prompt, body.images, "images")}
        messages, prompts = [*system, user], None
    return Generation(
        request_id=f"ollama-{uuid.uuid4().hex}",
        model=body.model,
        prompt_field="messages" if chat else "prompt",
        messages=messages,
        prompts=prompts,
        fill=fill,
        tools=tools,
        # think false: a prompt that does not think where the template has the switch, else the thoughts left
        # in the answer; true: apart; unset: as --reasoning-format says
        reasoning=Reasoning.asked(
            "none" if body.think is False else body.think if isinstance(body.think, str) else None,
            apart=None if body.think is None else body.think is not False,
        ),
        sampling=body.sampling(),
        api_defaults=API_DEFAULTS,
        names={k: f"options.{v}" for k, v in OPTION_NAMES.items()}
        | {k: f"options.{k}" for k in ("speculative", *SAMPLER_FIELDS)},
        constraint=Constraint("format", fmt=body.format) if body.format else None,
        keep_alive=body.keep_alive,
    )


async def answer(request: web.Request, run: Running, body, chat: bool, started: float):
    def line(text: str, calls: list | None = None, thinking: str = "") -> dict:
        head = {"model": run.name, "created_at": now_iso()}
        if not chat:
            return {**head, "response": text, **({"thinking": thinking} if thinking else {}), "done": False}
        made, unmade = ollama_calls(calls or [])
        if unmade:
            text = "\n".join([text, *unmade]) if text else "\n".join(unmade)
        message = {"role": "assistant", "content": text, **({"thinking": thinking} if thinking else {})}
        if made:
            message["tool_calls"] = made
        return {**head, "message": message, "done": False}

    if not body.stream:
        (c,) = await run.whole()
        thought, content, calls = c.parts
        counters = final_counters(c.last, run.prompt_tokens, len(c.token_ids), started)
        return web.json_response({**line(content or "", calls, thought), **counters})
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "X-Request-Id": run.gen.request_id})
    await resp.prepare(request)

    async def send(payload: dict) -> None:
        await resp.write(json.dumps(payload).encode() + b"\n")

    n = 0
    try:
        async with run.limit():
            # the reasoning streams apart; a tool call is held back and sent whole at the end
            async for _, out, (thought, text, calls) in run.deltas():
                n += len(out.token_ids)
                if out.error:
                    await send({"error": out.error})
                    break
                if thought:
                    await send(line("", None, thought))
                if text and not out.finished:
                    await send(line(text))
                if out.finished:
                    await send({**line(text, calls), **final_counters(out, run.prompt_tokens, n, started)})
    except ApiError as exc:  # the time limit, mid-stream: its error is the last line
        await send(error_body(exc))
    await resp.write_eof()
    return resp


def ollama_calls(calls: list[dict]) -> tuple[list[dict], list[str]]:
    """The model's tool calls in Ollama's shape (arguments as an object, no ids), and the text of those whose
    arguments are not a JSON object (a model can write a string there), which go to the content instead:
    Ollama's clients read arguments as an object."""
    made, unmade = [], []
    for c in calls:
        name, raw = c["function"]["name"], c["function"]["arguments"]
        try:
            args = json.loads(raw)
        except ValueError:
            args = None
        if isinstance(args, dict):
            made.append({"function": {"name": name, "arguments": args}})
        else:
            unmade.append(json.dumps({"name": name, "arguments": raw}, ensure_ascii=False))
    return made, unmade


async def chat(request: web.Request):
    return await respond(request, chat=True)


async def generate(request: web.Request):
    return await respond(request, chat=False)


def tag(name: str) -> str:
    """Ollama's full name of a model: with its tag (`:latest` when it has none); paths stay as they are."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def _time(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


def model_entry(entry: dict) -> dict:
    """A catalog entry (daemon/models/catalog.py) in /api/tags' shape."""
    weights, family = entry["quantization"], entry["family"]
    return {
        "name": tag(entry["id"]),
        "model": tag(entry["id"]),
        "modified_at": _time(entry["created"]),
        "size": entry["size"],
        "digest": "",
        "details": {
            "format": "gguf" if "native" in weights or entry["path"].endswith(".gguf") else "safetensors",
            "family": family,
            "families": [family] if family else [],
            "parameter_size": _parameter_size(entry["num_params"]),
            "quantization_level": weights,
        },
    }


def _parameter_size(params: int) -> str:
    """Ollama's way of writing a parameter count: 135M, 1.2B (empty when unknown)."""
    if not params:
        return ""
    return f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"


async def tags(request: web.Request) -> web.Response:
    """Every model this daemon can serve, loaded or not."""
    return web.json_response({"models": [model_entry(e) for e in await catalog(request.app[STATE])]})


async def ps(request: web.Request) -> web.Response:
    """The loaded models, with what they take and when they unload."""
    state = request.app[STATE]
    pool = state.pool
    entries = {e["id"]: e for e in await catalog(state) if e["loaded"]} if pool else {}
    out = []
    for m in pool.models.values() if pool else ():
        e = model_entry(entries[m.name]) if m.name in entries else {}
        vram = m.footprint if m.info.device == "cuda" else 0
        out.append(
            {
                **e,
                "size": m.footprint,
                "size_vram": vram,
                "expires_at": iso(m.expires_at),
                "context_length": m.info.max_model_len,
                "kv_cache_type": m.info.kv_cache_type,
                "kv_bytes_per_token": m.info.kv_bytes_per_token,
                "kv_cache_tokens": m.info.kv_cache_tokens,
                "loras": m.adapters.listing(),
            }
        )
    return web.json_response({"models": out})


async def show(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = parse_body(await read_raw(request, state) or b"{}", OllamaShowRequest)
    names = [n for n in (body.model, body.name) if n is not None]  # `name` is what older clients send
    if not names:
        raise ApiError(400, "model: the model name is required", "model", "missing")
    async with state.lease(names[0]) as m:  # the facts below are the loaded model's
        entry = model_entry(next(e for e in await catalog(state) if e["id"] == m.name))
        template = fill_template(m.tokenizer)
    return web.json_response(
        {
            "modelfile": "",
            "parameters": "",
            "template": template,
            "details": entry["details"],
            "model_info": {
                "general.architecture": m.info.family,
                "general.parameter_count": m.info.memory.num_params if m.info.memory else 0,
                "context_length": m.info.max_model_len,
            },
            "capabilities": capabilities(m.info.tasks, bool(template), m.info.vision is not None),
            "modified_at": entry["modified_at"],
        }
    )


def capabilities(tasks: tuple[str, ...], fills: bool, sees: bool = False) -> list[str]:
    """Ollama's capability words for what the model does: a decoder completes (and inserts, with
    fill-in-the-middle tokens, and sees, with a vision tower); an encoder embeds, or reranks (no Ollama word:
    ours)."""
    if "generate" in tasks:
        return ["completion"] + ["insert"] * fills + ["vision"] * sees
    return ["embedding" if t == "embed" else t for t in tasks]


FILL_TEMPLATE = "{{- if .Suffix }}%s{{ .Prompt }}%s{{ .Suffix }}%s{{- else }}{{ .Prompt }}{{- end }}"


def fill_template(tok: TextTokenizer) -> str:
    """For a model that fills in the middle, its markers in Ollama's template words (`.Suffix` is how Ollama's
    clients, Continue among them, tell that `suffix` is taken, as Ollama's `insert` capability); else empty.
    The prompt itself is assembled by engine/text/fim.py, not from this text."""
    if tok.fim is None:
        return ""
    marks = (tok.fim.prefix, tok.fim.suffix, tok.fim.middle)
    return FILL_TEMPLATE % tuple(tok.decode([t], skip_special_tokens=False) for t in marks)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": VERSION})


def owns(request: web.Request) -> bool:
    """Whether a request is one of Ollama's (its errors then take Ollama's shape)."""
    return request.path.startswith("/api/")


def error_body(exc: ApiError) -> dict:
    """Ollama's error shape: {"error": "field: message"}."""
    return {"error": exc.message}


def add_routes(app: web.Application) -> None:
    app.router.add_post("/api/chat", chat)
    app.router.add_post("/api/generate", generate)
    app.router.add_get("/api/tags", tags)
    app.router.add_get("/api/ps", ps)
    app.router.add_post("/api/show", show)
    app.router.add_get("/api/version", version)

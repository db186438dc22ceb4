"""llama-server's own endpoints, for the editor plugins and scripts that speak them (llama.vscode, llama.vim,
Continue's llama.cpp provider, Tabby, minuet...): `POST /completion` and `POST /infill`, whole or streamed as
server-sent events, answered with the fields they read (`content`, `stop`, `stop_type`, `tokens_predicted`,
`tokens_evaluated`, `tokens_cached`, `timings`). Fields this daemon has no use for (`cache_prompt`: the
prefix cache is always on; `id_slot`, `samplers`, `response_fields`...) are accepted and ignored, as
llama-server ignores what does not apply. `/infill` lays out its prompt with the model's own markers through
the pipeline's one assembly (engine/text/fim.py)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from minibatch.engine.core.sampling_params import MAX_LOGIT_BIAS, MAX_TOP_K
from minibatch.engine.text.fim import Infill

from ..generation import pipeline
from ..generation.images import MEDIA_MARKER, ImageInput
from ..generation.loras import MAX_ENTRIES, LoraScale
from ..generation.pipeline import Running
from ..generation.spec import Generation
from ..protocol import ApiError, Float, Int, parse_body
from ..state import STATE, off_loop, read_raw
from . import lora
from .openai_bodies import Bias, TokenIdKey
from .samplers import given_samplers, sampler_fields

MAX_EXTRA = 64  # input_extra chunks at most
MAX_FILENAME = 4096  # characters of a chunk's file name at most (a path's, PATH_MAX)
MAX_STOPS = 16
# llama-server's defaults for what a request leaves out
API_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class _Body(sampler_fields(_Lenient, "_LlamaSamplers")):
    model: StrictStr | None = None
    lora: list[LoraScale] | None = Field(default=None, max_length=MAX_ENTRIES)  # adapters by id, with scales
    n_predict: Int = Field(default=-1, ge=-1)  # -1: until the model stops or the context is full
    stream: StrictBool = False
    stop: list[StrictStr] = Field(default_factory=list, max_length=MAX_STOPS)
    temperature: Float | None = Field(default=None, ge=0.0, le=2.0)
    top_k: Int | None = Field(default=None, ge=0, le=MAX_TOP_K)
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)
    min_p: Float | None = Field(default=None, ge=0.0, le=1.0)
    repeat_penalty: Float | None = Field(default=None, gt=0.0, le=2.0)
    presence_penalty: Float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Float | None = Field(default=None, ge=-2.0, le=2.0)
    seed: Int | None = Field(default=None, ge=-1, le=2**63 - 1)  # -1: a random draw
    ignore_eos: StrictBool = False
    # token id -> bias: llama-server's [[id, bias], ...] or {"id": bias}
    logit_bias: list[Annotated[list[Float], Field(min_length=2, max_length=2)]] | dict[TokenIdKey, Bias] | None = Field(
        default=None, max_length=MAX_LOGIT_BIAS
    )
    # only these fields of the answer ("timings/prompt_n" reaches into timings), as llama.vscode asks
    response_fields: list[StrictStr] | None = Field(default=None, max_length=64)
    # after this long generating (from the first token), the answer ends at its next line break
    t_max_predict_ms: Int | None = Field(default=None, ge=0)
    # the cursor line's indentation (llama.vscode's): the answer ends before a later line indented less
    n_indent: Int = Field(default=0, ge=0, le=4096)
    return_tokens: StrictBool = False  # the answer's token ids in `tokens` (a stream's chunks always carry theirs)

    def sampling(self) -> dict:
        given = {
            k: v
            for k, v in {
                "temperature": self.temperature,
                "top_k": self.top_k,
                "top_p": self.top_p,
                "min_p": self.min_p,
                "repetition_penalty": self.repeat_penalty,
                "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty,
                "seed": None if self.seed == -1 else self.seed,
            }.items()
            if v is not None
        }
        if self.top_k == 0:  # llama-server's 0: off
            given["top_k"] = -1
        if self.n_predict >= 0:  # 0: the prompt is evaluated (its first token drawn, as a prefill does) and dropped
            given["max_tokens"] = max(1, self.n_predict)
        if self.stop:
            given["stop"] = self.stop
        if self.ignore_eos:
            given["ignore_eos"] = True
        if self.logit_bias:
            pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
            for i, (token, _) in enumerate(pairs):
                if float(token) != int(float(token)) or int(float(token)) < 0:
                    raise ApiError(400, f"logit_bias.{i}: a token id is a non-negative integer", f"logit_bias.{i}")
            given["logit_bias"] = {int(float(k)): float(v) for k, v in pairs}
        return given | given_samplers(self)


class MultimodalPrompt(_Body):
    """llama-server's prompt with images: each `<__media__>` in the text is where one of the images goes."""

    prompt_string: StrictStr
    multimodal_data: list[StrictStr] = Field(min_length=1)  # base64, in the markers' order


class CompletionBody(_Body):
    # a text, token ids, or a text with images
    prompt: Annotated[StrictStr, Field(min_length=1)] | Annotated[list[Int], Field(min_length=1)] | MultimodalPrompt


NAMES = {"max_tokens": "n_predict", "repetition_penalty": "repeat_penalty"}


class ExtraChunk(_Lenient):
    filename: StrictStr = Field(default="tmp", max_length=MAX_FILENAME)
    text: StrictStr = ""


class InfillBody(_Body):
    prompt: StrictStr = ""  # after the prefix: the line typed so far
    input_prefix: StrictStr = ""
    input_suffix: StrictStr = ""
    input_extra: list[ExtraChunk] = Field(default_factory=list, max_length=MAX_EXTRA)


def generation(body: CompletionBody | InfillBody) -> Generation:
    gen = Generation(
        request_id=f"llama-{uuid.uuid4().hex}",
        model=body.model,
        prompt_field="prompt",
        sampling=body.sampling(),
        api_defaults=API_DEFAULTS,
        names=NAMES,
        lora=body.lora,
    )
    if isinstance(body, InfillBody):
        extra = [(c.filename, c.text) for c in body.input_extra]
        gen.fill = Infill(body.input_prefix, body.input_suffix, body.prompt, extra)
        gen.fill_field, gen.fill_prefix_field = "input_suffix", "input_prefix"
    elif isinstance(body.prompt, MultimodalPrompt):
        gen.prompts = [body.prompt.prompt_string]
        data = body.prompt.multimodal_data
        gen.prompt_images = [ImageInput(f"prompt.multimodal_data.{j}", b64=b) for j, b in enumerate(data)]
    else:
        gen.prompts = [body.prompt]
    return gen


def result(model: str, content: str, run: Running, out, predicted: int, stop_type: str) -> dict:
    """llama-server's answer fields (the last chunk's, streamed)."""
    m = out.metrics if out is not None else None
    prompt_n = run.prompt_tokens
    prompt_ms = 1e3 * (m.ttft or 0.0) if m else 0.0
    predicted_ms = 1e3 * (m.decode_time or 0.0) if m else 0.0
    return {
        "content": content,
        "stop": True,
        "model": model,
        "tokens_predicted": predicted,
        "tokens_evaluated": prompt_n,
        "tokens_cached": m.cached_prompt_tokens if m else 0,
        "stop_type": stop_type,
        "stopping_word": "",
        "truncated": False,
        "has_new_line": "\n" in content,
        "timings": {
            "prompt_n": prompt_n - (m.cached_prompt_tokens if m else 0),
            "prompt_ms": prompt_ms,
            "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms else 0.0,
            "predicted_n": predicted,
            "predicted_ms": predicted_ms,
            "predicted_per_second": 1e3 * (predicted - 1) / predicted_ms if predicted_ms and predicted > 1 else 0.0,
        },
    }


def only(fields: list[str] | None, answer: dict) -> dict:
    """The answer cut to `response_fields` (a path as "timings/prompt_n" keeps that name), or whole."""
    if not fields:
        return answer
    out = {}
    for path in fields:
        value = answer
        for part in path.split("/"):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            out[path] = value
    return out


def _stop_type(out) -> str:
    return {"stop": "eos", "length": "limit"}.get(out.finish_reason or "", "eos") if out is not None else "limit"


async def respond(request: web.Request, fill: bool) -> web.StreamResponse:
    state = request.app[STATE]
    raw = await read_raw(request, state)
    body = await off_loop(parse_body, raw, InfillBody if fill else CompletionBody)
    gen = generation(body)
    limit_ms = body.t_max_predict_ms
    async with pipeline.generate(state, gen, request) as run:
        name = run.name
        if not body.stream:
            text, last, n, first_at, stop_type, ids = "", None, 0, None, None, []
            async with run.limit():
                async for _, out in run.outputs():
                    if out.error:
                        raise ApiError(500, out.error, None, "engine_error", "server_error")
                    if body.n_predict == 0:  # the prompt into the cache, nothing answered (llama.vim's warm-up)
                        last, stop_type = out, "limit"
                        continue
                    text += out.text
                    n += len(out.token_ids)
                    ids += out.token_ids
                    last = out if out.finished else last
                    first_at = first_at or time.monotonic()
                    cut = _dedent(text, body.n_indent)
                    if cut is not None:
                        text, stop_type = text[:cut], "limit"
                        break
                    if _past(limit_ms, first_at, text) and not out.finished:
                        break  # (leaving ends the request: its blocks go back at the next step)
            answer = result(name, text, run, last, n, stop_type or _stop_type(last))
            if body.return_tokens:
                answer["tokens"] = ids
            return web.json_response(only(body.response_fields, answer))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(payload: dict) -> None:
            await resp.write(b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n")

        def partial(text: str, ids: list[int], n: int) -> dict:
            return {"content": text, "tokens": ids, "stop": False, "tokens_predicted": n,
                    "tokens_evaluated": run.prompt_tokens}  # fmt: skip

        so_far, n, first_at = "", 0, None
        try:
            async with run.limit():
                async for _, out in run.outputs():
                    if out.error:
                        await send({"error": {"code": 500, "message": out.error, "type": "server_error"}})
                        break
                    if body.n_predict == 0:
                        if out.finished:
                            await send(only(body.response_fields, result(name, "", run, out, 0, "limit")))
                        continue
                    n += len(out.token_ids)
                    cut = _dedent(so_far + out.text, body.n_indent)
                    if cut is not None:  # a line indented less than the cursor's: the answer ends before it
                        if cut > len(so_far):
                            await send(partial((so_far + out.text)[len(so_far) : cut], out.token_ids, n))
                        await send(only(body.response_fields, result(name, "", run, None, n, "limit")))
                        break
                    so_far += out.text
                    first_at = first_at or time.monotonic()
                    if out.finished:
                        await send(only(body.response_fields, result(name, out.text, run, out, n, _stop_type(out))))
                        break
                    if out.token_ids:  # a chunk per step's tokens, as llama-server's (a special token's text is empty)
                        await send(partial(out.text, out.token_ids, n))
                    if _past(limit_ms, first_at, so_far):
                        await send(only(body.response_fields, result(name, "", run, None, n, "limit")))
                        break
        except ApiError as exc:  # the time limit, mid-stream: its error is the last event
            await send(exc.body())
        await resp.write_eof()
        return resp


def _dedent(text: str, n_indent: int) -> int | None:
    """llama-server's n_indent: where the answer ends when a line after its first starts with less indentation
    than `n_indent` (after that line's spaces and tabs), or None."""
    if n_indent <= 0:
        return None
    at = text.find("\n")
    while at != -1:
        pos = at + 1
        while pos < len(text) and text[pos] in " \t":
            pos += 1
        if pos < len(text) and text[pos] != "\n" and pos - (at + 1) < n_indent:
            return pos
        at = text.find("\n", at + 1)
    return None


def _past(limit_ms: int | None, first_at: float | None, text: str) -> bool:
    """llama-server's t_max_predict_ms: the time since the first token is past the limit and a line has ended."""
    return (
        limit_ms is not None
        and first_at is not None
        and (time.monotonic() - first_at) * 1e3 >= limit_ms
        and ("\n" in text)
    )


async def completion(request: web.Request) -> web.StreamResponse:
    return await respond(request, fill=False)


async def infill(request: web.Request) -> web.StreamResponse:
    return await respond(request, fill=True)


async def props(request: web.Request) -> web.Response:
    """llama-server's GET /props for a loaded model (?model=, default the daemon's own): its slots, context,
    chat template and what it takes in (`modalities`: vision where it has a tower)."""
    m = request.app[STATE].served(request.query.get("model") or None)
    body = {
        "model_alias": m.name,
        "total_slots": m.info.max_num_seqs,
        "default_generation_settings": {"n_ctx": m.info.max_model_len},
        "chat_template": m.tokenizer.chat_template or "",
        "modalities": {"vision": m.info.vision is not None, "audio": False},
        "media_marker": MEDIA_MARKER,  # where each of multimodal_data's images goes in a prompt string
    }
    return web.json_response(body)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/props", props)
    app.router.add_post("/completion", completion)
    app.router.add_post("/infill", infill)
    app.router.add_get("/lora-adapters", lora.get_adapters)
    app.router.add_post("/lora-adapters", lora.set_adapters)

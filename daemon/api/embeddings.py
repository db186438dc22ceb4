"""Embeddings: OpenAI's `POST /v1/embeddings` and Ollama's `POST /api/embed` (and its older `/api/embeddings`),
over the one pipeline (an embedding is a prefill-only request in the same continuous batch as the chats).

Any served model embeds: its hidden states after the final norm, pooled as the model declares (a GGUF's
pooling_type) or, for a decoder without one, at the last token. OpenAI's and `/api/embed`'s vectors are
normalised to length 1, as theirs are; `/api/embeddings` gives them as computed, as Ollama's does. Many inputs
in one request are many rows of one batch.
"""

from __future__ import annotations

import base64
import math
import struct
import time
import uuid
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, WithJsonSchema

from ..generation.pipeline import generate
from ..generation.spec import Generation
from ..protocol import ApiError, Float, Int
from ..state import STATE, read_body
from .messages import Body
from .openai_bodies import TOKEN_LIST

MAX_INPUTS = 512  # inputs in one request at most (each is a request in the batch)

INPUT_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_INPUTS},
        {**TOKEN_LIST, "minItems": 1, "description": "token ids"},
        {"type": "array", "items": {**TOKEN_LIST, "minItems": 1}, "minItems": 1, "maxItems": MAX_INPUTS},
    ],
    "description": "a text, a list of texts, token ids, or a list of token-id lists",
}


class EmbeddingRequest(Body):
    """OpenAI's body."""

    model: StrictStr | None = None
    input: Annotated[Any, WithJsonSchema(INPUT_SCHEMA)]  # checked by inputs(), which names the element at fault
    encoding_format: Literal["float", "base64"] = "float"
    # the first this-many values of each vector, normalised again (a Matryoshka model's shorter embedding:
    # nomic-embed-text v1.5, mxbai-embed-large), as OpenAI's and Ollama's `dimensions`
    dimensions: Int | None = Field(default=None, ge=1)
    user: StrictStr | None = None


class _Ollama(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: StrictStr | None = None
    keep_alive: StrictStr | Int | Float | None = None
    options: dict[str, Any] | None = None  # accepted; nothing in them changes an embedding


class OllamaEmbedRequest(_Ollama):
    input: Annotated[Any, WithJsonSchema(INPUT_SCHEMA)]
    truncate: StrictBool = True  # an input past the context keeps the tokens that fit (false: a 400)
    dimensions: Int | None = Field(default=None, ge=1)


class OllamaEmbeddingsRequest(_Ollama):
    prompt: StrictStr = Field(min_length=1)


def inputs(value: Any, field: str = "input") -> tuple[list[str | list[int]], bool]:
    """(the inputs, whether several were given): a text or token ids alone, or a list of either; an empty
    text, list or one past MAX_INPUTS is a 400 naming the element."""
    if isinstance(value, str):
        out, batch = [value], False
    elif isinstance(value, list) and value and all(_is_token(t) for t in value):
        return [[int(t) for t in value]], False
    elif isinstance(value, list) and value:
        if len(value) > MAX_INPUTS:
            raise ApiError(400, f"{field}: at most {MAX_INPUTS} inputs, got {len(value)}", field, "invalid_value")
        out, batch = [], True
        for i, item in enumerate(value):
            if isinstance(item, list) and item and all(_is_token(t) for t in item):
                out.append([int(t) for t in item])
            elif isinstance(item, str):
                out.append(item)
            else:
                where = f"{field}.{i}"
                raise ApiError(
                    400, f"{where}: must be a string or a non-empty list of token ids", where, "invalid_type"
                )
    else:
        msg = "must be a string, a list of strings, a list of token ids, or a list of token-id lists"
        raise ApiError(400, f"{field}: {msg}", field, "invalid_type")
    for i, item in enumerate(out):
        if item == "":
            where = f"{field}.{i}" if batch else field
            raise ApiError(400, f"{where}: the input is empty", where, "empty_input")
    return out, batch


def _is_token(t) -> bool:
    return (isinstance(t, int) and not isinstance(t, bool) and t >= 0) or (
        isinstance(t, float) and t.is_integer() and t >= 0
    )


async def _embed(request: web.Request, gen: Generation) -> tuple[list[list[float]], int, str]:
    """(the vectors in the inputs' order, the prompt tokens computed, the model's name)."""
    state = request.app[STATE]
    async with generate(state, gen, request) as running:
        choices = await running.whole()
        return [c.last.embedding for c in choices], running.prompt_tokens, running.name


def _unit(v: list[float]) -> list[float]:
    norm = math.sqrt(math.fsum(x * x for x in v))
    return [x / norm for x in v] if norm > 0 else v


async def openai_embeddings(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request, state, EmbeddingRequest)
    prompts, batch = inputs(body.input)
    gen = Generation(
        f"embd-{uuid.uuid4().hex[:24]}",
        body.model,
        "input",
        prompts=prompts,
        batch=batch,
        embed=True,
        dimensions=body.dimensions,
    )
    vectors, tokens, name = await _embed(request, gen)
    data = []
    for i, v in enumerate(vectors):
        v = _unit(v[: body.dimensions])
        value: Any = v if body.encoding_format == "float" else base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()
        data.append({"object": "embedding", "index": i, "embedding": value})
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return web.json_response({"object": "list", "data": data, "model": name, "usage": usage})


def _ollama_generation(
    body: _Ollama, prompts, batch: bool, truncate: bool, operator: bool, dimensions: int | None = None
) -> Generation:
    return Generation(
        f"embd-{uuid.uuid4().hex[:24]}",
        body.model,
        "input" if isinstance(body, OllamaEmbedRequest) else "prompt",
        prompts=prompts,
        batch=batch,
        keep_alive=body.keep_alive,
        operator=operator,
        embed=True,
        truncate=truncate,
        dimensions=dimensions,
    )


async def ollama_embed(request: web.Request) -> web.Response:
    state = request.app[STATE]
    started = time.perf_counter()
    body = await read_body(request, state, OllamaEmbedRequest)
    prompts, batch = inputs(body.input)
    gen = _ollama_generation(body, prompts, batch, body.truncate, state.is_operator(request), body.dimensions)
    vectors, tokens, name = await _embed(request, gen)
    return web.json_response(
        {
            "model": name,
            "embeddings": [_unit(v[: body.dimensions]) for v in vectors],
            "total_duration": int((time.perf_counter() - started) * 1e9),
            "load_duration": 0,
            "prompt_eval_count": tokens,
        }
    )


async def ollama_embeddings(request: web.Request) -> web.Response:
    """The older endpoint: one prompt, its vector as computed (not normalised), as Ollama's."""
    state = request.app[STATE]
    body = await read_body(request, state, OllamaEmbeddingsRequest)
    gen = _ollama_generation(body, [body.prompt], False, True, state.is_operator(request))
    vectors, _, _ = await _embed(request, gen)
    return web.json_response({"embedding": vectors[0]})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", openai_embeddings)
    app.router.add_post("/api/embed", ollama_embed)
    app.router.add_post("/api/embeddings", ollama_embeddings)

"""llama-server's `GET`/`POST /lora-adapters`: the scales a model's LoRA adapters apply with to requests that
name the base model and give no `lora` list (generation/loras.py). The answers name adapters, never their
files."""

from __future__ import annotations

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from ..generation.loras import MAX_ENTRIES, LoraScale, named
from ..models.loaded import LoadedModel
from ..protocol import ApiError, parse_body
from ..state import STATE, read_raw


class LoraScales(BaseModel):
    """POST /lora-adapters: llama-server's bare list, or {"model": ..., "adapters": [...]} for another model."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    adapters: list[LoraScale] = Field(max_length=MAX_ENTRIES)


def _listing(model: LoadedModel) -> list[dict]:
    return [
        {"id": i, "name": name, "scale": model.lora_scales.get(name, 0.0)}
        for i, name in enumerate(model.adapters.names)
    ]


async def get_adapters(request: web.Request) -> web.Response:
    """llama-server's GET /lora-adapters: each adapter of the model (?model=, default the daemon's own) by id,
    with the scale a request that names the base model and gives no `lora` runs under."""
    model = request.app[STATE].served(request.query.get("model") or None)
    return web.json_response(_listing(model))


async def set_adapters(request: web.Request) -> web.Response:
    """llama-server's POST /lora-adapters: the scales of the listed adapters; those left out go to 0."""
    state = request.app[STATE]
    raw = await read_raw(request, state)
    body = parse_body(raw if raw.lstrip()[:1] != b"[" else b'{"adapters": ' + raw + b"}", LoraScales)
    model = state.served(body.model)
    scales = named(model, body.adapters, "adapters")
    if len({n for n, _ in scales}) != len(scales):
        raise ApiError(400, "adapters: an adapter is listed twice", "adapters", "invalid_value")
    model.lora_scales = {n: s for n, s in scales if s != 0.0}
    return web.json_response(_listing(model))

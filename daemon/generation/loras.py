"""Which LoRA adapters a request runs under: the one its `model` names, llama-server's `lora` list of ids and
scales (a body field of the OpenAI-style faces and llama-server's own), or the model's scales
(POST /lora-adapters). Ids are the adapters' places in the model's `--lora` list."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from minibatch.engine.lora.names import LoraUses, lora_uses

from ..models.loaded import LoadedModel
from ..protocol import ApiError, Float, Int

MAX_SCALE = 100.0  # an adapter's scale at most, either sign (past it a float32 forward overflows)
MAX_ENTRIES = 64


class LoraScale(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    id: Int = Field(ge=0)
    scale: Float = Field(ge=-MAX_SCALE, le=MAX_SCALE)


def named(model: LoadedModel, given: list[LoraScale], field: str) -> list[tuple[str, float]]:
    """The (adapter name, scale) pairs `given` by id, or a 400 naming `field`'s entry whose id is not one."""
    names = model.adapters.names
    out = []
    for i, ask in enumerate(given):
        if ask.id >= len(names):
            have = f"ids 0 to {len(names) - 1}" if names else "none"
            msg = f"{field}.{i}.id: model {model.name!r} has no LoRA adapter {ask.id} (it has {have})"
            raise ApiError(400, msg, f"{field}.{i}.id", "invalid_value")
        out.append((names[ask.id], ask.scale))
    return out


def request_loras(model: LoadedModel, adapter: str | None, given: list[LoraScale] | None) -> LoraUses:
    """The adapters a request runs under: the one its model names (scale 1), then its `lora` list's scales by
    id over those; with neither, the model's scales (POST /lora-adapters)."""
    if given is None:
        return lora_uses([(adapter, 1.0)]) if adapter else lora_uses(model.lora_scales.items())
    scales = {adapter: 1.0} if adapter else {}
    scales.update(dict(named(model, given, "lora")))
    try:
        return lora_uses(scales.items())
    except ValueError as exc:
        raise ApiError(400, f"lora: {exc}", "lora", "invalid_value") from None

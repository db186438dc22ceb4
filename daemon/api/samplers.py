"""The samplers beyond the common five as body fields (llama-server's names), taken from the engine's one
table of their ranges (EXTRA_SAMPLERS), for every face with a place for them: the OpenAI-style bodies as
extra fields, Ollama's options."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field, StrictStr, create_model

from minibatch.engine.core.sampling_params import (
    EXTRA_SAMPLERS,
    MAX_DRY_BREAKER_CHARS,
    MAX_DRY_BREAKERS,
    Bound,
)

from ..protocol import Float, Int

SAMPLER_FIELDS = (*EXTRA_SAMPLERS, "dry_sequence_breakers")


def _field(bound: Bound) -> Any:
    kind = Int if bound.integer else Float
    lo = {"gt": bound.lo} if bound.lo_open else {"ge": bound.lo}
    return Annotated[kind | None, Field(le=bound.hi, **lo)], None


def sampler_fields(base: type[BaseModel], name: str) -> type[BaseModel]:
    """A model with `base`'s config holding one optional field per sampler setting (unset: the engine's
    default, which leaves the sampler off)."""
    fields: dict[str, Any] = {k: _field(b) for k, b in EXTRA_SAMPLERS.items()}
    breaker = Annotated[StrictStr, Field(min_length=1, max_length=MAX_DRY_BREAKER_CHARS)]
    fields["dry_sequence_breakers"] = (list[breaker] | None, Field(default=None, max_length=MAX_DRY_BREAKERS))
    return create_model(name, __base__=base, **fields)


def given_samplers(body: BaseModel) -> dict[str, Any]:
    """The sampler settings `body` sets, in SamplingParams' names (the same as the fields')."""
    return {k: getattr(body, k) for k in SAMPLER_FIELDS if getattr(body, k) is not None}

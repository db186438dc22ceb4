"""A model's names: how a request's name is normalised and resolved (never to a path: a request names a
model, not a file), how an operator's name or path becomes a spec, and how a model is shown."""

from __future__ import annotations

from pathlib import Path

from minibatch.engine.store import sources
from minibatch.engine.store.cache import (
    BUILTIN_MODELS,
    ModelNotFoundError,
    canonical_name,
    listed_spec,
    servable_names,
)

from ..protocol import ApiError

normal_name = canonical_name  # the one normalisation of a model's name (engine/store/cache.py)


def spec_of(name: str) -> str:
    """What resolve_model takes for a name the operator gave (--model, --preload): any path, or a built-in
    alias or a models-folder name with the `:latest` Ollama clients add."""
    base = name.removesuffix(":latest")
    if base != name and (base in BUILTIN_MODELS or sources.resolve_local(base) or Path(base).expanduser().exists()):
        return base
    return name


def display_name(name: str) -> str:
    """How a model the operator named by its path is shown: its file's name without .gguf, or its folder's
    (answers show no server path); any other name as it is."""
    if "/" not in name and not name.startswith("~"):
        return name
    path = Path(name).expanduser()
    return path.stem if path.suffix == ".gguf" else path.name or name


def cut(name: str, limit: int = 64) -> str:
    """A client's name as the answers and the log show it: at most `limit` characters."""
    return name if len(name) <= limit else name[: limit - 3] + "..."


def listed(name: str) -> str:
    """The spec of a name a request gave, or a 404 whose text depends on the catalog alone (never on what
    the filesystem holds at a path the name might spell)."""
    try:
        spec = listed_spec(name)
    except ModelNotFoundError as exc:
        raise ApiError(404, f"model {cut(name)!r}: {exc}", "model", "model_not_found") from None
    if spec is None:
        names = ", ".join(n for n in servable_names()) or "none"
        raise ApiError(
            404,
            f"model {cut(name)!r} does not exist here; this daemon serves: {names} "
            "(GET /v1/models lists them; a request names a model, not a file)",
            "model",
            "model_not_found",
        )
    return spec

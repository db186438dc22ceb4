"""How many models a daemon keeps loaded, for how long and in how much memory: the settings the CLI, the
cluster and models/pool.py share, and Ollama's keep_alive durations. Light to import (the CLI reads it)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

DEFAULT_KEEP_ALIVE = 300.0  # seconds a model loaded on demand stays after its last request (Ollama's 5m)
DEFAULT_MAX_LOADED = 3  # Ollama's default on a CPU
DEFAULT_MEMORY_SHARE = 0.8  # of the machine's memory (a GPU's, on a GPU), when no --models-memory-gb is given
DEFAULT_LOAD_WAIT = 60.0  # seconds a load waits for a busy model to free the room
MAX_KEEP_ALIVE = 365 * 86400.0  # the longest finite keep_alive (a negative one keeps the model loaded)
ENGINE_LOOPS = ("shared", "per-model")
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value, field_name: str = "keep_alive") -> float | None:
    """Seconds a model stays loaded after a request, as Ollama reads keep_alive: a number of seconds or a
    duration ("5m", "1h30m", "250ms"); 0 unloads after the request; negative keeps it loaded (None)."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f'{field_name}: a duration such as "5m" or a number of seconds, got {value!r}')
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = str(value).strip()
        try:
            seconds = float(text)
        except ValueError:
            sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text)
            parts = _DURATION.findall(body)
            if not parts or "".join(n + u for n, u in parts) != body:
                raise ValueError(
                    f'{field_name}: {_short(value)} is not a duration (say "5m", "30s", "1h", 0 or -1)'
                ) from None
            seconds = sign * sum(float(n) * _UNIT[u] for n, u in parts)
    if not math.isfinite(seconds):
        raise ValueError(f"{field_name}: must be finite, got {value!r}")
    if seconds > MAX_KEEP_ALIVE:
        raise ValueError(
            f"{field_name}: at most {MAX_KEEP_ALIVE / 3600:g}h (365 days), got {_short(value)}; "
            "a negative value keeps the model loaded"
        )
    return None if seconds < 0 else seconds


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# Engine options a model's own settings may change (--model-settings): what sizes and shapes its engine. The
# daemon-wide ones (threads, device) and the model itself are the daemon's.
PER_MODEL_OPTIONS = (
    "kv_cache_type",
    "kv_cache_gb",
    "kv_cache_tokens",
    "kv_cache_fraction",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "weights",
    "speculative",
    "num_speculative_tokens",
    "draft_model",
    "mode",
)


def read_model_settings(path: str | None) -> dict[str, dict]:
    """--model-settings: a JSON object of model names, each an object of engine options (PER_MODEL_OPTIONS,
    named as the flags are without the dashes, or as EngineConfig's fields) for that model alone. Its shape and
    option names are checked here (a ValueError naming the file and the key refuses the start); the values when
    the model loads, so a bad one fails that model's load, naming it, and the daemon serves the others."""
    if not path:
        return {}
    import json

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--model-settings {path}: {exc}") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f"--model-settings {path}: an object of model names, each an object of options")
    out = {}
    for model, options in data.items():
        fields = {}
        for key, value in options.items():
            field_name = key.lstrip("-").replace("-", "_")
            if field_name not in PER_MODEL_OPTIONS:
                raise ValueError(
                    f"--model-settings {path}: {model!r}: {key!r} is not a per-model option; they are "
                    f"{', '.join(o.replace('_', '-') for o in PER_MODEL_OPTIONS)}"
                )
            fields[field_name] = value
        out[model] = fields
    return out


@dataclass(frozen=True, slots=True)
class PoolSettings:
    on_demand: bool = True  # False: only the preloaded models answer (a cluster replica serves one)
    max_loaded: int = DEFAULT_MAX_LOADED
    memory_bytes: int | None = None  # None: DEFAULT_MEMORY_SHARE of the device's memory
    keep_alive: float | None = DEFAULT_KEEP_ALIVE  # for models loaded on demand; None: until evicted
    load_wait: float = DEFAULT_LOAD_WAIT
    engine_loop: str = "shared"
    model_settings: dict[str, dict] = field(default_factory=dict)  # read_model_settings: name -> engine options

    def __post_init__(self) -> None:
        if self.max_loaded < 1:
            raise ValueError(f"max_loaded_models must be at least 1, got {self.max_loaded}")
        if self.engine_loop not in ENGINE_LOOPS:
            raise ValueError(f"engine_loop must be one of {', '.join(ENGINE_LOOPS)}, got {self.engine_loop!r}")
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise ValueError(f"models_memory_gb must be positive, got {self.memory_bytes / 2**30:g}")

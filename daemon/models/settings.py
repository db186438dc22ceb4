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
    "lora",
    "max_lora_rank",
    "max_loras",
    "lora_dir",
    "mmproj",
    "max_images",
    "max_image_bytes",
    "max_image_pixels",
)


def read_model_settings(path: str | None, base=None) -> dict[str, dict]:
    """--model-settings: a JSON object of model names, each an object of engine options (PER_MODEL_OPTIONS,
    named as the flags are without the dashes, or as EngineConfig's fields) for that model alone. Read and
    checked at start: the file's text, its shape, each option's name and value as its flag takes it, and each
    model's options together over `base` (the daemon's EngineConfig); anything wrong is a ValueError naming
    the option, the file, the model and the setting, and the daemon does not start. What depends on the model
    itself (a KV cache type its heads cannot hold) fails that model's load, naming it."""
    if not path:
        return {}
    where = f"--model-settings {path}"
    data = _read_json(path, where)
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f"{where}: an object of model names, each an object of options")
    out = {}
    for model, options in data.items():
        fields = {}
        for key, value in options.items():
            field_name = key.lstrip("-").replace("-", "_")
            if field_name not in PER_MODEL_OPTIONS:
                raise ValueError(
                    f"{where}: {_short(model)}: {_short(key)} is not a per-model option; they are "
                    f"{', '.join(o.replace('_', '-') for o in PER_MODEL_OPTIONS)}"
                )
            try:
                fields[field_name] = setting_value(field_name, value)
            except ValueError as exc:
                raise ValueError(f"{where}: {_short(model)}: {key}: {exc}") from None
        if base is not None:
            import dataclasses

            try:
                dataclasses.replace(base, **fields)  # each limit's range, and the options together
            except ValueError as exc:
                raise ValueError(f"{where}: {_short(model)}: {exc}") from None
        out[model] = fields
    return out


def setting_value(field_name: str, value):
    """A per-model setting's value as its flag takes it (a JSON number for a string option, a string of digits
    for a number), or a ValueError saying what it must be; null, for an option whose default is none, that
    default."""
    from minibatch.engine.options import DEFAULTS, ENGINE_OPTIONS

    kind = next(o.type for o in ENGINE_OPTIONS if o.field == field_name)
    if value is None and DEFAULTS[field_name] is None:
        return None  # the option's own default (the model's context, the budget's rule)
    if value is None or isinstance(value, (dict, list, bool)):
        raise ValueError(f"must be {_KINDS[kind]}, got {_short(value)}")
    if kind is str:
        return str(value)
    try:
        number = kind(value)
    except (ValueError, OverflowError):
        raise ValueError(f"must be {_KINDS[kind]}, got {_short(value)}") from None
    if isinstance(number, float) and not math.isfinite(number) or kind is int and float(value) != number:
        raise ValueError(f"must be {_KINDS[kind]}, got {_short(value)}")
    return number


_KINDS = {int: "an integer", float: "a finite number", str: "a string"}
MAX_SETTINGS_BYTES = 1 << 20  # a settings file is a few lines; past this it is not one


def _read_json(path: str, where: str):
    """The file's JSON, or a ValueError naming `where` for whatever else it holds (not UTF-8, not JSON, nested
    past the parser's depth, NaN and Infinity, which JSON does not have)."""
    import json

    def no_constant(name: str):
        raise ValueError(f"{name} is not a JSON number")

    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_SETTINGS_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{where}: {exc.strerror or exc}") from None
    if len(raw) > MAX_SETTINGS_BYTES:
        raise ValueError(f"{where}: larger than {MAX_SETTINGS_BYTES >> 20} MiB; it is not a settings file")
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=no_constant)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where}: not UTF-8 text (byte {exc.start} is 0x{raw[exc.start]:02x})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{where}: not JSON this daemon reads: nested too deeply") from None
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


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

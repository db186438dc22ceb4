"""A loaded model as the API holds it (its engine, tokenizer, monitor, LoRA adapters and lifetime), and a
request's keep_alive."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from ..protocol import ApiError
from .adapters import ModelAdapters
from .settings import parse_duration

if TYPE_CHECKING:
    from minibatch.engine.async_engine import AsyncEngine
    from minibatch.engine.core.info import EngineInfo
    from minibatch.engine.step_loop import StepLoop
    from minibatch.engine.text.structured import GrammarCompiler
    from minibatch.engine.text.tokenizer import TextTokenizer

    from ..monitor import EngineMonitor


def parse_keep_alive(value, field_name: str = "keep_alive") -> float | None:
    """A request's keep_alive (settings.parse_duration), or a 400 naming the field."""
    try:
        return parse_duration(value, field_name)
    except ValueError as exc:
        raise ApiError(400, str(exc), field_name, "invalid_value") from None


@dataclass(slots=True)
class KeepAlive:
    """A request's keep_alive for the model it leases (`seconds`, as parse_keep_alive reads it: None keeps the
    model loaded); `operator`: the request is the operator's own (state.is_operator). It applies when the lease
    ends, and only once the request was `taken` (admitted, or a load asked for): a refused request leaves the
    model's lifetime as it was."""

    seconds: float | None
    operator: bool = False
    taken: bool = False


def iso(ts: float | None) -> str:
    """Ollama's way of writing a time; a model that never expires shows Go's zero time, as Ollama's do."""
    if ts is None:
        return "0001-01-01T00:00:00Z"
    ts = min(ts, 253402300799.0)  # 9999-12-31T23:59:59Z, the last time the format holds
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(eq=False)
class LoadedModel:
    """One loaded model: its engine and what the API needs beside it."""

    name: str
    engine: AsyncEngine
    tokenizer: TextTokenizer
    grammars: GrammarCompiler | None
    info: EngineInfo
    monitor: EngineMonitor
    loop: StepLoop
    load_seconds: float
    keep_alive: float | None  # this model's default: None while preloaded, else the daemon's --keep-alive
    adapters: ModelAdapters  # its LoRA adapters: those it may serve, those resident, who holds them
    names: set[str] = field(default_factory=set)  # normal_name of every name it answers to
    loaded_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    expires_at: float | None = None  # wall time it unloads once idle; None: never
    leases: int = 0  # requests holding it
    loaded: bool = True
    # the scales of its LoRA adapters for requests that name it and give no `lora` list (POST /lora-adapters)
    lora_scales: dict[str, float] = field(default_factory=dict)
    baked: tuple[str, ...] = ()  # the files its Ollama layers add (its ADAPTERs, its projector): adapters.baked_files

    @property
    def footprint(self) -> int:
        """Bytes it holds: the weights as loaded, its LoRA adapters' and the KV pool."""
        memory = self.info.memory.loaded_bytes if self.info.memory else 0
        return memory + self.adapters.nbytes + self.info.kv_cache_bytes

    @property
    def busy(self) -> bool:
        return self.leases > 0 or not self.engine.idle

    def ready_engine(self) -> AsyncEngine:
        if not self.engine.alive:
            why = self.engine.fatal_error or "the engine has stopped"
            raise ApiError(503, f"{self.name}: {why}; see the log", None, "engine_dead", "unavailable")
        return self.engine

    def touch(self, keep_alive: float | None) -> None:
        self.last_used = time.monotonic()
        self.expires_at = None if keep_alive is None else time.time() + keep_alive

    def facts(self) -> dict:
        """/health's entry for it: the engine's facts and its lifetime."""
        st = self.engine.state
        return (
            self.info.as_dict(public=True)
            | {
                "model": self.name,
                "name": self.name,
                "mode": st.mode,
                "running": st.running,
                "waiting": st.waiting,
                "alive": self.engine.alive,
                "loaded_at": iso(self.loaded_at),
                "load_seconds": round(self.load_seconds, 2),
                "expires_at": iso(self.expires_at),
                "memory_bytes": self.footprint,
            }
            | self.adapters.facts()
        )

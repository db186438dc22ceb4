"""A loaded model's LoRA adapters: every one it may serve by name, those resident in its engine, and the
requests that hold each.

The names: `--lora`'s (checked at the model's load), then those its `--lora-dir` holds, added as requests
name them; a `lora` list's ids are places in this order, which only grows. At most `--max-loras` are resident
(stacked as the kernels read them): a request naming another reads it from its file off the event loop, then
it takes the place of the least recently used one that no request holds, or waits for one to be let go
(within the request's deadline). A request holds its adapters from before it is submitted to its end, so an
adapter is never let go under a row that runs with it. Its blocks stay in the prefix caches under its
weights' digest: read again, its prompts are hits again."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from minibatch.engine.lora.adapter import LoraAdapter, LoraError
from minibatch.engine.lora.names import adapter_files, parse_loras
from minibatch.engine.lora.rows import WEIGHTS
from minibatch.engine.store import sources

from ..protocol import ApiError

if TYPE_CHECKING:
    from minibatch.engine.async_engine import AsyncEngine
    from minibatch.engine.factory import EngineConfig

log = logging.getLogger("minibatch.daemon")


def baked_adapters(spec: str) -> dict[str, Path]:
    """The LoRA adapters a model of Ollama's store runs under (its Modelfile's ADAPTER lines), by the names its
    engine serves them as (`adapter0`, ...); none for any other model."""
    if not spec.startswith("ollama:"):
        return {}
    try:
        return {f"adapter{i}": p for i, p in enumerate(sources.ollama_adapters(spec.removeprefix("ollama:")))}
    except sources.SourceError:
        return {}  # (the load itself says what is wrong with the model)


def baked_projector(spec: str) -> Path | None:
    """The vision tower a model of Ollama's store sees images with (its projector layer, an mmproj GGUF);
    None for any other model, for one without it, and for a projector of a family not read here (Ollama's
    library ships llava-style ones): that model serves text as before, and the log says why it sees nothing."""
    if not spec.startswith("ollama:"):
        return None
    try:
        projector = sources.ollama_projector(spec.removeprefix("ollama:"))
    except sources.SourceError:
        return None  # (the load itself says what is wrong with the model)
    return projector if projector is None or _readable(spec, projector) else None


@functools.lru_cache(maxsize=64)
def _readable(spec: str, projector: Path) -> bool:
    from minibatch.engine.vision.loader import mmproj_problem

    problem = mmproj_problem(projector)
    if problem is not None:  # (said once per model and file)
        log.warning(
            "model %s: its projector layer %s is not read here (%s): it takes no images", spec, projector.name, problem
        )
    return problem is None


def baked_files(spec: str) -> tuple[str, ...]:
    """What an Ollama model's own layers add to its weights' file (its ADAPTERs, its projector): the same file
    with other layers is another model."""
    projector = baked_projector(spec)
    return tuple(str(p) for p in baked_adapters(spec).values()) + ((str(projector),) if projector else ())


def served_bytes(adapter: LoraAdapter) -> int:
    """What an adapter's matrices take as the kernels keep them (rows.WEIGHTS), its rank's rows alone."""
    return adapter.nbytes // 4 * WEIGHTS.itemsize  # (nbytes: float32's, also once its weights are let go)


class ModelAdapters:
    def __init__(self, model: str, engine: AsyncEngine, config: EngineConfig) -> None:
        self.model = model
        self.engine = engine
        self.paths: dict[str, str] = dict(parse_loras(config.lora))  # every name it may serve, in id order
        self.folder = Path(config.lora_dir).expanduser() if config.lora_dir else None
        self.max_resident = config.max_loras
        # resident in the engine, least recently used first: name -> its bytes
        self.resident: OrderedDict[str, int] = OrderedDict((n, served_bytes(a)) for n, a in engine.engine.loras.items())
        self.nbytes = engine.engine.runner.lora_bytes()  # all the resident adapters take, stacked
        self.holds: Counter[str] = Counter()
        self._loading = asyncio.Lock()  # one read and swap at a time
        self._let_go = asyncio.Event()  # a hold ended: a waiting read may find room
        self._swaps: dict[str, asyncio.Future[int]] = {}  # adapters resident once the engine has taken them

    @property
    def names(self) -> list[str]:
        return list(self.paths)

    def find(self, name: str) -> bool:
        """Whether it serves an adapter of that name (one its folder holds now is added to its names)."""
        if name in self.paths:
            return True
        path = adapter_files(self.folder).get(name) if self.folder is not None else None
        if path is not None:
            self.paths[name] = str(path)
        return path is not None

    @asynccontextmanager
    async def held(self, names: Iterable[str]) -> AsyncIterator[None]:
        """The adapters `names`, resident and held until the block ends."""
        wanted = sorted(set(names))
        if len(wanted) > self.max_resident:
            raise ApiError(
                400,
                f"lora: the request runs under {len(wanted)} LoRA adapters; this model keeps at most "
                f"{self.max_resident} resident (--max-loras)",
                "lora",
                "invalid_value",
            )
        for name in wanted:
            if not self.find(name):  # (a name the daemon routed here, gone from the folder since)
                raise ApiError(404, f"model {name!r}: no such LoRA adapter here", "model", "model_not_found")
        self.holds.update(wanted)
        try:
            for name in wanted:
                if name in self.resident:
                    self.resident.move_to_end(name)
                else:
                    await self._load(name)
                await self._taken(name)
            yield
        finally:
            self.holds.subtract(wanted)
            if any(self.holds[n] == 0 for n in wanted):
                self.holds += Counter()  # (drops the names no request holds)
                self._let_go.set()

    async def _load(self, name: str) -> None:
        async with self._loading:
            if name in self.resident:  # read by the request before this one
                self.resident.move_to_end(name)
                return
            reader = self.engine.engine.lora_reader
            assert reader is not None  # (a model with adapter names was built with one)
            try:
                adapter = await asyncio.to_thread(reader, self.paths[name], name)
            except LoraError as exc:
                log.error("could not load LoRA adapter %s of %s: %s", name, self.model, exc)
                raise ApiError(
                    500,
                    f"LoRA adapter {name!r} could not be loaded: {exc}",
                    "model",
                    "model_load_failed",
                    "server_error",
                ) from None
            victim = None
            while len(self.resident) >= self.max_resident:
                victim = next((n for n in self.resident if self.holds[n] == 0), None)
                if victim is not None:
                    break
                self._let_go.clear()
                await self._let_go.wait()
            # From here nothing awaits before the swap is queued: the engine takes it in order with the
            # submissions, whatever becomes of this request.
            if victim is not None:
                del self.resident[victim]
            self.resident[name] = served_bytes(adapter)
            core = self.engine.engine

            def swap() -> int:
                if victim is not None:
                    core.remove_lora(victim)
                core.add_lora(adapter)
                return core.runner.lora_bytes()

            done = self._swaps[name] = self.engine.call(swap)
            done.add_done_callback(self._swapped(name))
            log.info("LoRA adapter %s of %s loaded%s", name, self.model, f" in place of {victim}" if victim else "")

    async def _taken(self, name: str) -> None:
        """Once the engine has taken the adapter (a swap queued by this request or another)."""
        swap = self._swaps.get(name)
        if swap is None:
            return
        try:
            await asyncio.shield(swap)
        except Exception as exc:
            raise ApiError(
                500,
                f"LoRA adapter {name!r} could not be served: {type(exc).__name__} (see the daemon's log)",
                "model",
                "model_load_failed",
                "server_error",
            ) from None

    def _swapped(self, name: str):
        def settle(done: asyncio.Future[int]) -> None:
            self._swaps.pop(name, None)
            if done.cancelled():
                return
            if done.exception() is not None:
                log.error("could not serve LoRA adapter %s of %s: %s", name, self.model, done.exception())
                self.resident.pop(name, None)
                return
            self.nbytes = done.result()

        return settle

    def listing(self) -> list[dict]:
        """The resident adapters, most recently used first, with what each takes."""
        return [{"name": n, "size": size} for n, size in reversed(self.resident.items())]

    def facts(self) -> dict:
        """/health's: the names it serves, those resident and what they take."""
        return {"loras": self.names, "loras_resident": self.listing(), "lora_bytes": self.nbytes}

"""The models one daemon serves: loaded by name on first use, several at once, each its own engine, unloaded
when their keep-alive runs out or another model needs the room.

Every loaded model has its own engine (scheduler, batch, KV pool, mode) and monitor. By default they share
one step loop (engine/step_loop.py): their steps alternate on one thread, so two models never run two
OpenMP teams on the same cores at once (BENCHMARKS.md, "Several models", measures it against a thread per
model, `--engine-loop per-model`). A load runs on the loop's thread too and pauses the other models' steps
while it builds.

Room: at most `max_loaded` models, and their weights plus KV pools within the memory budget. A model that
does not fit evicts the least recently used idle one; a model with requests running or waiting is never
evicted, and the load waits for room up to `load_wait` seconds, then answers 503 naming who holds it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from minibatch.engine.factory import EngineConfig
from minibatch.engine.lora.names import adapter_files, parse_loras
from minibatch.engine.models.config import ModelSettingError
from minibatch.engine.store.cache import (
    ModelNotFoundError,
    list_models,
    resolve_model,
)

from ..monitor import EngineMonitor, Metrics, StepSignal
from ..protocol import ApiError
from .adapters import ModelAdapters, baked_adapters, baked_files, baked_projector
from .loaded import KeepAlive, LoadedModel
from .names import cut, display_name, listed, normal_name, spec_of
from .settings import DEFAULT_MEMORY_SHARE, PoolSettings

if TYPE_CHECKING:
    from minibatch.engine.step_loop import StepLoop

log = logging.getLogger("minibatch.daemon")


def weights_bytes_on_disk(model_dir: Path) -> int:
    """The model's weight files as stored: what a load of native weights takes, before its KV pool."""
    source = model_dir / "minibatch-source.json"
    if source.is_file():
        gguf = json.loads(source.read_text()).get("gguf")
        if gguf and Path(gguf).is_file():
            return Path(gguf).stat().st_size
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def total_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            import os

            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


class ModelPool:
    """The loaded models by name, and the rules that load and unload them."""

    def __init__(self, base: EngineConfig, settings: PoolSettings, loop: asyncio.AbstractEventLoop) -> None:
        self.base = base
        self.settings = settings
        self.loop = loop
        self.default_name = base.model
        self.models: dict[str, LoadedModel] = {}
        self.loading: dict[str, asyncio.Future] = {}
        self.failed: dict[str, str] = {}  # the last load error by name (listed or the operator's names only)
        # the names the operator gave (--model, --preload) and the names they are shown by, each to what it
        # loads: a request may name these too, whatever they are
        self.operator_specs = {}
        self._add_operator_names([self.default_name])
        # LoRA adapters by name -> the model they run over: --lora's over the daemon's own model, a model's own
        # `lora` in --model-settings over that model
        self.adapters: dict[str, str] = {name: self.default_name for name in parse_loras(base.lora)}
        # and the folders of adapters served by name on demand (--lora-dir; a model's own `lora-dir`) -> theirs
        self.adapter_dirs: dict[Path, str] = (
            {Path(base.lora_dir).expanduser(): self.default_name} if base.lora_dir else {}
        )
        for model, options in settings.model_settings.items():
            self.adapters.update({name: model for name in parse_loras(options.get("lora"))})
            if options.get("lora_dir"):
                self.adapter_dirs[Path(options["lora_dir"]).expanduser()] = model
        self.metrics = Metrics()
        self.signal = StepSignal()  # any model stepped, loaded or unloaded: the event streams look again
        self.lost = asyncio.Event()  # an engine lost its device: the daemon exits
        self.lost_error: str | None = None
        self._load_lock = asyncio.Lock()
        self._room = asyncio.Event()
        self._shared: StepLoop | None = None
        self._budget: int | None = settings.memory_bytes
        self._expiry: asyncio.Task | None = None
        self._collect_after: tuple[str, str, int] | None = None  # an unloaded model whose memory is to free

    # -- finding ---------------------------------------------------------------
    def find(self, name: str | None) -> LoadedModel | None:
        """The loaded model a request's name means (none or "default": the daemon's own), if loaded."""
        want = normal_name(self.default_name if name in (None, "", "default") else name)
        for m in self.models.values():
            if want in m.names:
                return m
        return None

    def adapter_route(self, name: str | None) -> tuple[str | None, str | None]:
        """(the model to lease, the LoRA adapter to run under) for a request's model name: an adapter's name
        means its base model under it; any other name the model itself, under none."""
        if not name:
            return name, None
        base = self.adapters.get(name)
        if base is None and self.adapter_dirs:
            base = next((m for folder, m in self.adapter_dirs.items() if name in adapter_files(folder)), None)
        return (name, None) if base is None else (base, name)

    def adapter_names(self) -> dict[str, str]:
        """Every adapter a request may name -> the model it runs over: --lora's, the models' own, then what
        the adapter folders hold now."""
        out = dict(self.adapters)
        for folder, model in self.adapter_dirs.items():
            for name in adapter_files(folder):
                out.setdefault(name, model)
        return out

    def default(self) -> LoadedModel | None:
        """The model the engine endpoints show without ?model=: the daemon's own, else the latest used."""
        m = self.find(None)
        if m is not None:
            return m
        return max(self.models.values(), key=lambda m: m.last_used, default=None)

    def served(self, name: str | None) -> LoadedModel:
        """A loaded model for the engine endpoints (?model=), or 404/503 saying what is loaded."""
        m = self.find(name) if name else self.default()
        if m is not None:
            return m
        loaded = ", ".join(sorted(self.models)) or "none"
        if name:
            raise ApiError(404, f"model {cut(name)!r} is not loaded (loaded: {loaded})", "model", "model_not_loaded")
        if self.loading:
            raise ApiError(503, "the model is still loading", None, "not_ready", "unavailable", {"Retry-After": "2"})
        raise ApiError(503, "no model is loaded; a request loads one by name", None, "no_model_loaded", "unavailable")

    # -- loading ---------------------------------------------------------------
    async def get(self, name: str | None, operator: bool = False) -> LoadedModel:
        """The model a name means, loaded now if it is not (the caller waits for the load). A request's name
        (`operator` False) must be one the catalog lists: a request names models, never files; the
        operator's (--model, --preload, and a request without a name, which means --model) may be a path."""
        operator = operator or name in (None, "", "default") or normal_name(name) in self.operator_specs
        while True:
            m = self.find(name)
            if m is not None:
                return m
            requested = self.default_name if name in (None, "", "default") else name
            if not self.settings.on_demand and normal_name(requested) != normal_name(self.default_name):
                raise ApiError(
                    404,
                    f"model {cut(requested)!r} does not exist; this daemon serves {self.default_name!r}",
                    "model",
                    "model_not_found",
                )
            if operator:
                spec = self.operator_specs.get(normal_name(requested)) or spec_of(requested)
            else:
                spec = await asyncio.to_thread(listed, requested)
            key = normal_name(requested)
            fut = self.loading.get(key)
            if fut is None:
                fut = self.loading[key] = asyncio.ensure_future(self._load(requested, spec, operator))
                fut.add_done_callback(lambda _f, k=key: (self.loading.pop(k, None), self.signal.bump()))
                self.signal.bump()  # the chat's panel shows it loading
            m = await asyncio.shield(fut)
            if m.loaded:  # (an eviction may have taken it between the load and this task's turn)
                return m

    @asynccontextmanager
    async def lease(self, name: str | None, keep: KeepAlive | None = None) -> AsyncIterator[LoadedModel]:
        """The model, held for one request: never evicted meanwhile; its keep-alive restarts at the end
        (`keep`: the request's own, once the request was taken; else the model's)."""
        m = await self.get(name)  # (loaded: nothing runs between its return and the lease)
        m.leases += 1
        try:
            yield m
        finally:
            m.leases -= 1
            # a model the operator loaded keeps its lifetime unless the operator's own request changes it
            own = keep is None or not keep.taken or (self.operators_model(m) and not keep.operator)
            m.touch(m.keep_alive if own else keep.seconds)
            self._room.set()
            if m.expires_at is not None and m.expires_at <= time.time() and m.leases == 0:
                asyncio.ensure_future(self._unload_when_idle(m, "keep_alive 0"))

    def operators_model(self, m: LoadedModel) -> bool:
        """Loaded under a name the operator gave (--model, --preload): it stays loaded whoever loads it again,
        and only the operator's own requests (the socket's user) change its lifetime."""
        return bool(m.names & self.operator_specs.keys())

    def _add_operator_names(self, names) -> None:
        for name in names:
            spec = spec_of(name)
            self.operator_specs[normal_name(name)] = spec
            self.operator_specs.setdefault(normal_name(display_name(name)), spec)

    def loaded_or_loading(self, name: str | None) -> bool:
        return self.find(name) is not None or normal_name(name or self.default_name) in self.loading

    def model_config(self, spec: str, name: str) -> EngineConfig:
        """The engine options of `spec` (shown as `name`): the daemon's, with its KV rule for several models on
        a GPU, and its own settings (--model-settings, found by any of its names) on top; a value its settings
        get wrong is a ModelSettingError naming the model."""
        own = {}
        for key, options in self.settings.model_settings.items():
            if normal_name(key) in {normal_name(n) for n in (spec, name, display_name(spec))}:
                own = options
        baked = baked_adapters(spec)
        if baked and "lora" not in own:  # an Ollama model's own (its Modelfile's ADAPTER)
            own = {**own, "lora": ",".join(f"{n}={p}" for n, p in baked.items())}
        elif "lora" not in own and spec != spec_of(self.default_name):  # --lora's adapters are the daemon's model's
            own = {**own, "lora": None}
        if "mmproj" not in own:
            projector = baked_projector(spec)
            if projector is not None and (self.base.mmproj is None or spec != spec_of(self.default_name)):
                own = {**own, "mmproj": str(projector)}  # an Ollama vision model's own tower (its projector layer)
            elif spec != spec_of(self.default_name):  # --mmproj's tower is the daemon's model's
                own = {**own, "mmproj": None}
        try:  # (each value read as its flag takes it and checked over the daemon's at start: settings.py)
            cfg = dataclasses.replace(self.base, model=spec, **own)
        except (TypeError, ValueError) as exc:
            raise ModelSettingError(f"--model-settings for {cut(name)!r}: {exc}") from None
        if cfg.kv_cache_gb is None and cfg.kv_cache_tokens is None and cfg.kv_cache_fraction is None:
            if self._device() == "cuda":  # each model takes its share of the free memory at its load
                from minibatch.engine.factory import DEFAULT_KV_FRACTION

                cfg.kv_cache_fraction = DEFAULT_KV_FRACTION["cuda"] / self.settings.max_loaded
        return cfg

    def _device(self) -> str:
        if self.base.device != "auto":
            return self.base.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def budget(self) -> int:
        """The memory the loaded models' weights and KV pools may take together."""
        if self._budget is None:
            if self._device() == "cuda":
                import torch

                total, what = torch.cuda.mem_get_info()[1], "GPU memory"
            else:
                total, what = total_memory_bytes(), "memory"
            self._budget = int(total * DEFAULT_MEMORY_SHARE)
            log.info(
                "models may take %.1f GiB (%g of the %s; --models-memory-gb sets it), %d loaded at most",
                self._budget / 2**30,
                DEFAULT_MEMORY_SHARE,
                what,
                self.settings.max_loaded,
            )
        return self._budget

    async def _load(self, requested: str, spec: str, operator: bool) -> LoadedModel:
        """Resolve and load `requested`: `spec` is what it resolved to (a listed name's spec, or the operator's
        own, which may be any path)."""
        async with self._load_lock:
            m = self.find(requested)  # loaded meanwhile, under another of its names
            if m is not None:
                return m
            try:
                model_dir = await asyncio.to_thread(resolve_model, spec, None, False)
            except ModelNotFoundError as exc:
                message = str(exc)
                if operator and "On this machine" not in message:
                    names = ", ".join(e.name for e in list_models() if e.ready) or "none"
                    message += f"; models here: {names}"
                if not operator:  # listed, yet it cannot be prepared: what is wrong goes to the log
                    log.error("model %s (%s) cannot be prepared: %s", cut(requested), spec, message)
                    message = "it is listed but cannot be prepared; see the daemon's log"
                raise ApiError(
                    404, f"model {cut(requested)!r} does not exist here: {message}", "model", "model_not_found"
                ) from None
            except Exception as exc:  # a file that is there but cannot be read as a model
                raise self._failed(requested, exc) from None
            baked = baked_files(spec)
            for m in self.models.values():  # another name of a loaded model (the same file and baked layers)
                if m.info.model_dir == str(model_dir) and m.baked == baked:
                    m.names.add(normal_name(requested))
                    return m
            await self._make_room(requested, weights_bytes_on_disk(Path(model_dir)))
            m = await self._build(requested, spec)
            await self._fit(m)
            return m

    async def _build(self, requested: str, spec: str) -> LoadedModel:
        from minibatch.engine.step_loop import StepLoop

        name = display_name(requested)  # how it is shown: never a server path
        if name != requested and name in self.models:
            name = requested  # two of the operator's files of one name: the second keeps its path

        if self.settings.engine_loop == "shared":
            if self._shared is None or not self._shared.alive:
                self._shared = StepLoop()
                self._shared.start()
            loop = self._shared
        else:
            loop = StepLoop(name=f"minibatch-engine-{len(self.models)}", private=True)
            loop.start()
        log.info("loading model %s", name)
        started = time.perf_counter()
        baked, files = baked_adapters(spec), baked_files(spec)
        try:
            config = self.model_config(spec, name)
            engine, tokenizer = await asyncio.wrap_future(loop.call(lambda: _build_engine(config)))
        except Exception as exc:
            if loop.private:
                loop.stop()
            raise self._failed(name, exc) from None
        self.failed.pop(normal_name(name), None)
        monitor = EngineMonitor(self.loop, name, self.metrics, self.signal)
        engine.stats_listeners.append(monitor.on_step_threadsafe)
        info = engine.info
        m = LoadedModel(
            name=name,
            engine=engine,
            tokenizer=tokenizer,
            grammars=_grammar_compiler(engine, tokenizer),
            info=info,
            monitor=monitor,
            loop=loop,
            load_seconds=time.perf_counter() - started,
            keep_alive=self.settings.keep_alive,
            adapters=ModelAdapters(name, engine, config),
            # (not by its file's folder when an Ollama layer is baked in: the same file without it is another model)
            names={normal_name(name), normal_name(requested)} | (set() if files else {normal_name(info.model_dir)}),
            # an Ollama model's ADAPTER applies to its every request, as in Ollama (a `lora` list still changes it)
            lora_scales={n: 1.0 for n in baked if n in info.loras},
            baked=files,
        )
        engine.on_detach.append(lambda: self.loop.call_soon_threadsafe(self._detached, m))
        loop.attach(engine)
        if self.operators_model(m):  # the operator's (also when a request loads it again): stays loaded
            m.keep_alive = None
        m.touch(m.keep_alive)
        self.models[name] = m
        self.signal.bump()
        self.metrics.loaded.labels(name).set(1)
        for mode in ("continuous", "static"):
            self.metrics.mode.labels(name, mode).set(1 if engine.mode == mode else 0)
        self.metrics.load_seconds.labels(name).set(m.load_seconds)
        self.metrics.memory.labels(name).set(m.footprint)
        log.info(
            "ready in %.1f s: %s (%s, %.0f MB, KV %.0f MB: %d tokens of %s, %d bytes each) on %s (%s), "
            "%d KV blocks of %d tokens (%s), mode %s, speculative %s",
            m.load_seconds,
            name,
            info.weights,
            info.memory.loaded_bytes / 1e6 if info.memory else 0,
            info.kv_cache_bytes / 1e6,
            info.kv_cache_tokens,
            info.kv_cache_type,
            info.kv_bytes_per_token,
            info.device,
            info.dtype,
            info.num_kv_blocks,
            info.block_size,
            info.kv_budget,
            engine.mode,
            info.speculative,
        )
        return m

    def _failed(self, name: str, exc: Exception) -> ApiError:
        """A model that cannot be loaded: logged with why, kept for /health by its name (only names the
        catalog lists or the operator gave get this far: the dict is bounded by the catalog), answered naming
        it and the kind of failure (the log has the rest, which may name the server's files)."""
        log.error("could not load model %s: %s: %s", cut(name), type(exc).__name__, exc)
        # a setting the model cannot take says which (its text names no server file); anything else, its kind
        why = str(exc) if isinstance(exc, ModelSettingError) else f"{type(exc).__name__} (see the daemon's log)"
        self.failed[normal_name(name)] = why
        return ApiError(
            500, f"model {cut(name)!r} could not be loaded: {why}", "model", "model_load_failed", "server_error"
        )

    async def preload(self, names: list[str]) -> None:
        """Load the start's models (the first is the daemon's own); they stay loaded until evicted or
        unloaded by a request's keep_alive."""
        self._add_operator_names(names)
        for name in names:
            m = await self.get(name, operator=True)
            m.keep_alive = None
            m.touch(None)

    def _holders(self) -> str:
        return ", ".join(
            f"{m.name} ({m.engine.state.running} running, {m.engine.state.waiting} waiting, "
            f"{m.footprint / 2**20:.0f} MB)"
            for m in self.models.values()
        )

    async def _make_room(self, name: str, estimate: int) -> None:
        """Unload idle models, least recently used first, until `name` fits; wait for busy ones to finish."""
        budget = self.budget()
        if estimate > budget:
            raise ApiError(
                503,
                f"model {name!r} needs about {estimate / 2**30:.1f} GiB, more than the models' memory budget of "
                f"{budget / 2**30:.1f} GiB (--models-memory-gb)",
                "model",
                "model_too_large",
                "unavailable",
            )
        deadline = time.monotonic() + self.settings.load_wait
        while True:
            used = sum(m.footprint for m in self.models.values())
            if len(self.models) < self.settings.max_loaded and used + estimate <= budget:
                return
            idle = [m for m in self.models.values() if not m.busy]
            if idle:
                await self.unload(min(idle, key=lambda m: m.last_used), f"to make room for {name}")
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise ApiError(
                    503,
                    f"no room to load model {name!r}: {self._holders()} hold it, every one busy "
                    f"(--max-loaded-models {self.settings.max_loaded}, memory budget {budget / 2**30:.1f} GiB); "
                    f"waited {self.settings.load_wait:g} s",
                    "model",
                    "no_room",
                    "unavailable",
                    {"Retry-After": "5"},
                )
            self._room.clear()
            try:
                async with asyncio.timeout(min(left, 1.0)):
                    await self._room.wait()
            except TimeoutError:
                pass

    async def _fit(self, new: LoadedModel) -> None:
        """After a load: its real footprint may exceed the estimate; unload idle others until all fit."""
        budget = self.budget()
        while sum(m.footprint for m in self.models.values()) > budget:
            idle = [m for m in self.models.values() if m is not new and not m.busy]
            if not idle:
                log.warning("the loaded models take more than the memory budget: %s", self._holders())
                return
            await self.unload(min(idle, key=lambda m: m.last_used), f"to make room for {new.name}")

    # -- unloading -------------------------------------------------------------
    async def unload(self, m: LoadedModel, why: str) -> None:
        """Stop its engine and return its memory (the requests it still has end with an error)."""
        if not m.loaded:
            return
        m.loaded = False
        self.models.pop(m.name, None)
        before = rss_bytes()
        if not m.engine.idle:
            m.engine.abort_all(f"model {m.name} was unloaded ({why})")
        await asyncio.to_thread(m.engine.shutdown)
        self.metrics.forget(m.name)
        m.monitor.close()
        m.engine.stats_listeners.clear()
        # Its memory is freed by the next expiry tick, once the requests' frames that saw it have ended.
        self._collect_after = (m.name, why, before)
        log.info("unloaded %s (%s)", m.name, why)
        self._room.set()

    async def _unload_when_idle(self, m: LoadedModel, why: str) -> None:
        while m.loaded and not m.engine.idle and m.leases == 0:
            await asyncio.sleep(0.05)
        if m.loaded and m.leases == 0 and m.expires_at is not None and m.expires_at <= time.time():
            await self.unload(m, why)

    def _detached(self, m: LoadedModel) -> None:
        """On the event loop: a model's engine left its loop; a lost device ends the daemon."""
        if m.engine.fatal_error is not None:
            self.lost_error = f"{m.name}: {m.engine.fatal_error}"
            self.lost.set()

    def start_expiry(self) -> None:
        self._expiry = asyncio.ensure_future(self._expire())

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            await self._expire_once()
            if self._collect_after is not None:
                name, why, before = self._collect_after
                self._collect_after = None
                await asyncio.to_thread(_collect)
                log.info("%s's memory returned: RSS %.0f -> %.0f MB", name, before / 2**20, rss_bytes() / 2**20)

    async def _expire_once(self) -> None:
        """(Its own coroutine: no model stays referenced from the sleeping loop's frame.)"""
        now = time.time()
        for m in [m for m in self.models.values() if m.expires_at is not None and m.expires_at <= now]:
            if not m.busy:
                await self.unload(m, "keep_alive expired")

    # -- the whole daemon ------------------------------------------------------
    @property
    def idle(self) -> bool:
        return all(m.engine.idle for m in self.models.values())

    def abort_all(self, error: str) -> None:
        for m in self.models.values():
            m.engine.abort_all(error)

    async def close(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        for m in list(self.models.values()):
            m.loaded = False
            await asyncio.to_thread(m.engine.shutdown)
        self.models.clear()
        if self._shared is not None:
            self._shared.stop()


def _build_engine(config: EngineConfig):
    """On the step loop's thread: the engine and its tokenizer."""
    from minibatch.engine.async_engine import AsyncEngine
    from minibatch.engine.factory import build_engine

    engine = build_engine(config)
    return AsyncEngine(engine), engine.tokenizer


def _grammar_compiler(engine, tokenizer):
    """What compiles response formats for this model (its vocabulary is read on first use), or None."""
    from minibatch.engine.text.structured import GrammarCompiler

    if not tokenizer.has_tokenizer_json:
        return None
    return GrammarCompiler(tokenizer.tokenizer_json, engine.info.vocab_size, list(engine.info.eos_token_ids))


def _collect() -> None:
    """An unloaded model's memory back to the OS: its cycles collected, the heap trimmed, a GPU's cache freed."""
    from minibatch.engine.heap import release_free_memory

    gc.collect()
    release_free_memory()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()

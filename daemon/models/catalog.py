"""What a daemon can serve, as /v1/models and Ollama's /api/tags list it: the loaded models, then every model
this machine holds that the engine runs (`minibatchd models`' list), each under the name a request gives."""

from __future__ import annotations

import asyncio
import time

from minibatch.engine.store.cache import ModelEntry, list_models

from .names import normal_name


def client_name(entry: ModelEntry) -> str:
    """The name a client sends back: Ollama's models without our `ollama:` prefix, as Ollama lists them."""
    return entry.name.removeprefix("ollama:")


async def catalog(state) -> list[dict]:
    """[{id, created, loaded, max_model_len, size, family, quantization, path, vision}], the loaded models
    first."""
    pool = state.pool
    loaded = list(pool.models.values()) if pool else []
    out = [
        {
            "id": m.name,
            "created": int(m.loaded_at),
            "loaded": True,
            "max_model_len": m.info.max_model_len,
            "size": m.footprint,
            "family": m.info.family,
            "quantization": m.info.weights,
            "num_params": m.info.memory.num_params if m.info.memory else 0,
            "path": m.info.model_dir,
            "vision": m.info.vision is not None,
        }
        for m in loaded
    ]
    if pool is not None and not pool.settings.on_demand:
        return out
    seen = {n for m in loaded for n in m.names}
    for entry in await asyncio.to_thread(list_models):
        if not entry.ready and entry.kind != "builtin":
            continue  # a family the engine does not run, or a file it cannot read
        if entry.kind == "converted":
            continue  # a file the operator once named by its path: not a name a request may give
        name = client_name(entry)
        if normal_name(name) in seen or (entry.path is not None and normal_name(str(entry.path)) in seen):
            continue
        seen.add(normal_name(name))
        out.append(
            {
                "id": name,
                "created": int(entry.path.stat().st_mtime) if entry.path and entry.path.exists() else int(time.time()),
                "loaded": False,
                "max_model_len": None,
                "size": entry.path.stat().st_size if entry.path and entry.path.is_file() else 0,
                "family": entry.note.split(" · ")[0] if " · " in entry.note else "",
                "quantization": entry.note.split(" · ")[1] if entry.note.count(" · ") >= 1 else "",
                "num_params": 0,
                "path": str(entry.path) if entry.path else "",
                "vision": entry.note.endswith("sees images"),  # (a vision folder; a GGUF's --mmproj shows once loaded)
            }
        )
    return out

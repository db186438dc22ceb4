"""The OpenAPI document: valid OpenAPI 3.1, and exactly the routes the server registers."""

from __future__ import annotations

import pytest

from minibatch.daemon.api.openapi import document
from minibatch.daemon.app import create_app
from minibatch.daemon.state import DaemonState


def test_the_document_is_valid_openapi_3_1():
    validator = pytest.importorskip("openapi_spec_validator")
    for doc in (document(), document("some-model", 49152)):
        assert doc["openapi"] == "3.1.0"
        validator.validate(doc)  # raises on any violation of the 3.1 schema


def test_every_registered_route_is_documented_and_nothing_else():
    app = create_app(DaemonState(model_name="m"))
    routes = {(r.method.lower(), r.resource.canonical) for r in app.router.routes() if r.method not in ("HEAD", "*")}
    documented = {(method, path) for path, ops in document()["paths"].items() for method in ops}
    assert len(routes) >= 18
    assert routes == documented, (routes - documented, documented - routes)


def test_request_bodies_are_the_models_the_daemon_validates_with():
    from minibatch.daemon.api import ollama
    from minibatch.daemon.api.openai_bodies import ChatRequest

    doc = document()
    schemas = doc["components"]["schemas"]
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat == {"$ref": "#/components/schemas/ChatRequest"}
    assert set(schemas["ChatRequest"]["properties"]) == set(ChatRequest.model_fields)
    assert schemas["ChatRequest"]["additionalProperties"] is False  # unknown fields are refused
    assert "additionalProperties" not in schemas["ChatBody"]  # Ollama's are ignored, as Ollama does
    assert set(schemas["ChatBody"]["properties"]) == set(ollama.ChatBody.model_fields)


def test_the_served_document_states_the_models_facts():
    doc = document("tiny", 1000)
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    # any name the daemon can serve, loaded on first use (a name it lacks is a 404 listing what it has)
    assert {"type": "string"} in props["model"]["anyOf"] and "'tiny'" in props["model"]["description"]
    tokens = [v for v in props["prompt"]["anyOf"] if v["type"] == "array" and v["items"].get("type") == "integer"]
    assert tokens and all(v["items"]["maximum"] == 999 and v["items"]["minimum"] == 0 for v in tokens)


def test_the_document_is_the_same_in_every_process():
    """The daemon serves what the code makes, in any process: nothing in it may take its order from a set
    (pydantic lists a Literal's values in whatever order the process's typing objects hold them; the
    document sorts every enum), whatever the hash seed or what was imported before."""
    import os
    import subprocess
    import sys

    make = "import json; from minibatch.daemon.api.openapi import document; print(json.dumps(document('m', 99)))"
    docs = {
        subprocess.run(
            [sys.executable, "-c", before + make],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONHASHSEED": seed},
            check=True,
        ).stdout
        for before, seed in (("", "1"), ("", "2"), ("import typing; typing.Literal['', 'json']; ", "3"))
    }
    assert len(docs) == 1


def test_the_documented_stats_are_the_monitors():
    """The stats body and each model's compact line are documented with exactly the fields the monitor derives
    from the engine's dataclasses (a field added to EngineState shows up here or this fails)."""
    from dataclasses import fields

    from minibatch.daemon.api import schemas
    from minibatch.daemon.monitor import COMPACT, FINISHED, MEANS, RATES, STATS_SUMMED
    from minibatch.engine.core.outputs import EngineState

    assert set(schemas.ModelStats.model_fields) == set(COMPACT) | {"state"}
    state = {f.name for f in fields(EngineState)} - {"step", "timestamp"}
    derived = state | set(FINISHED) | set(RATES) | set(MEANS) | set(STATS_SUMMED)
    own = {"kv_usage_percent", "prefix_cache_hit_rate", "cpu_wait_share", "last_error", "recent_steps"}
    listing = {"model", "models", "totals"}
    from minibatch.engine.vision.images import IMAGE_COUNTS  # a vision model's tower

    assert set(schemas.Stats.model_fields) == derived | own | listing | set(IMAGE_COUNTS)

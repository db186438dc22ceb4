"""The API as an OpenAPI 3.1 document, made from the models the daemon validates and answers with.

Request bodies come from protocol.py's and ollama.py's models (the ones `parse_body` validates with),
answers from schemas.py, the engine's facts from its own dataclasses. What is written here by hand is
only what no model holds: which path takes which body, answers with which model and status codes, and
the query parameters the handlers read. `GET /openapi.json` serves it; a test checks that it lists
exactly the routes the server registers, and the fuzz test checks every answer against it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, TypeAdapter
from pydantic.json_schema import models_json_schema

from minibatch.engine.core.info import EngineInfo

from ..protocol import MAX_BODY_BYTES
from . import (
    anthropic,
    anthropic_bodies,
    embeddings,
    llama,
    lora,
    ollama,
    rerank,
    response_store,
    responses_bodies,
    schemas,
    tokens,
)
from .openai_bodies import ChatRequest, CompletionRequest

REF = "#/components/schemas/{model}"
JSON, SSE, NDJSON, TEXT = "application/json", "text/event-stream", "application/x-ndjson", "text/plain"

# Status codes by what an operation does (each with the error shape of its API).
GUARDED = {401: "no or a wrong API key (TCP listener)", 403: "a foreign Host or Origin (TCP listener)"}
BODY = {
    400: "the body is not valid: the message and `param` name the field and the limit",
    408: "the body did not arrive in time",
    413: f"the body is over {MAX_BODY_BYTES} bytes",
    415: "the body is not application/json (TCP listener)",
}
ENGINE = {503: "the model is loading, or the daemon is shutting down"}
MODEL = {
    404: "a model name this machine does not have (the message lists what it has)",
    500: "the model named could not be loaded (the message says why)",
    503: "no room to load the model: every loaded model is busy (the message names them)",
}
GENERATE = {
    429: "the batch and the queue behind it are full (Retry-After: 1)",
    500: "the engine failed while running the request",
    504: "the request ran past the daemon's --request-timeout",
}


def _events(what: str) -> dict:
    """A server-sent event stream, described (as OpenAPI 3.1 tools read it) by the schema of one event."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"type": "string", "contentMediaType": JSON, "description": what}},
        "description": "server-sent events, `data: ...` each",
    }


def _query(name: str, schema: dict, description: str) -> dict:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


def _path(name: str, pattern: str) -> dict:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string", "pattern": pattern}}


# (method, path, summary, request body model or None, {status: (description, {media type: model or schema})},
#  error statuses, query parameters)
def _operations() -> list[tuple]:
    s = schemas
    chunks = "a chunk ({}), an error object, or [DONE] to end"
    gen_chat = {JSON: s.ChatCompletion, SSE: _events(chunks.format("chat.completion.chunk"))}
    gen_text = {JSON: s.Completion, SSE: _events(chunks.format("text_completion"))}
    gen = {**GUARDED, **BODY, **ENGINE, **MODEL, **GENERATE}
    olla_gen = {**GUARDED, **BODY, **ENGINE, **MODEL, **GENERATE}
    steps = _query("steps", {"type": "integer", "minimum": 0, "maximum": 600}, "recent steps to include (20)")
    since = _query("since", {"type": "integer", "minimum": 0}, "the records after this step (0: all kept)")
    model = _query("model", {"type": "string"}, "which loaded model (default: the daemon's own)")
    loaded = {404: "no loaded model has that name"}
    return [
        (
            "get",
            "/health",
            "the daemon's state and the engine's facts (503 unless ready)",
            None,
            {200: {JSON: s.Health}, 503: {JSON: s.Health}},
            {**GUARDED},
            [],
        ),
        ("get", "/openapi.json", "this document", None, {200: {JSON: {"type": "object"}}}, {**GUARDED}, []),
        (
            "get",
            "/v1/models",
            "every model the daemon can serve, loaded first",
            None,
            {200: {JSON: s.ModelList}},
            {**GUARDED},
            [],
        ),
        ("post", "/v1/chat/completions", "a chat completion", ChatRequest, {200: gen_chat}, gen, []),
        (
            "post",
            "/v1/completions",
            "a text completion (or a batch of prompts)",
            CompletionRequest,
            {200: gen_text},
            gen,
            [],
        ),
        (
            "get",
            "/v1/engine/stats",
            "the engine now, its rates and its recent steps",
            None,
            {200: {JSON: s.Stats}},
            {**GUARDED, 400: BODY[400], **ENGINE, **loaded},
            [steps, model],
        ),
        (
            "get",
            "/v1/engine/events",
            "one server-sent event per engine step, for as long as the client stays",
            None,
            {200: {SSE: _events("one engine step: its counters and the rates")}},
            {**GUARDED, **ENGINE, **loaded},
            [model],
        ),
        (
            "get",
            "/v1/engine/blocks",
            "KV blocks by owning request",
            None,
            {200: {JSON: s.BlockMap}},
            {**GUARDED, **ENGINE, **loaded},
            [model],
        ),
        (
            "get",
            "/v1/engine/steps",
            "the batch timeline",
            None,
            {200: {JSON: s.Timeline}},
            {**GUARDED, 400: BODY[400], **ENGINE, **loaded},
            [since, model],
        ),
        (
            "get",
            "/props",
            "llama-server: a loaded model's slots, context, chat template and modalities (vision: it takes images)",
            None,
            {200: {JSON: s.Props}},
            {**GUARDED, **ENGINE, **loaded},
            [model],
        ),
        (
            "get",
            "/lora-adapters",
            "llama-server: the model's LoRA adapters by id, with the scales of requests that name the base model",
            None,
            {200: {JSON: s.LoraAdapters}},
            {**GUARDED, **ENGINE, **loaded},
            [model],
        ),
        (
            "post",
            "/lora-adapters",
            "llama-server: those scales (its bare list, or `model` and `adapters`); adapters left out go to 0",
            lora.LoraScales,
            {200: {JSON: s.LoraAdapters}},
            {**GUARDED, **BODY, **ENGINE, **loaded},
            [],
        ),
        (
            "get",
            "/v1/engine/mode",
            "the batching mode",
            None,
            {200: {JSON: s.ModeState}},
            {**GUARDED, **ENGINE, **loaded},
            [model],
        ),
        (
            "put",
            "/v1/engine/mode",
            "switch the batching mode at the next batch boundary (every loaded model's, or ?model='s)",
            s.ModeRequest,
            {202: {JSON: s.ModeSwitch}},
            {**GUARDED, **BODY, **ENGINE, **loaded},
            [model],
        ),
        (
            "get",
            "/v1/prompt-cache",
            "the disk prompt cache: its bytes against the budget, each model's blocks",
            None,
            {200: {JSON: s.PromptCache}},
            {**GUARDED, **ENGINE},
            [],
        ),
        (
            "delete",
            "/v1/prompt-cache",
            "clear the disk prompt cache (one model's blocks with ?model=); the daemon's own user only",
            None,
            {200: {JSON: s.PromptCacheCleared}},
            {
                **GUARDED,
                403: "not the daemon's own user (over its socket, without a key), or a foreign Host or Origin",
                **ENGINE,
                404: "the cache holds no blocks of that model",
            },  # fmt: skip
            [_query("model", {"type": "string"}, "only this model's blocks (a name or identity as listed)")],
        ),
        ("get", "/metrics", "Prometheus metrics", None, {200: {TEXT: {"type": "string"}}}, {**GUARDED}, []),
        (
            "post",
            "/v1/messages",
            "Anthropic: a message (streamed as Anthropic's events with stream: true)",
            anthropic_bodies.MessagesRequest,
            {200: {JSON: s.AnthropicMessageOut, SSE: _events("one of Anthropic's message stream events")}},
            gen,
            [],
        ),
        (
            "post",
            "/v1/messages/count_tokens",
            "Anthropic: the prompt tokens a message request would take",
            anthropic_bodies.CountTokensRequest,
            {200: {JSON: s.TokenCount}},
            {**GUARDED, **BODY, **ENGINE, **MODEL},
            [],
        ),
        (
            "post",
            "/v1/responses",
            "OpenAI Responses: a response (streamed as response.* events with stream: true)",
            responses_bodies.ResponsesRequest,
            {200: {JSON: s.ResponseOut, SSE: _events("one response.* event")}},
            {**gen, 404: "a model name this machine lacks, or a previous_response_id not stored (or expired)"},
            [],
        ),
        (
            "post",
            "/v1/responses/input_tokens",
            "OpenAI Responses: the prompt tokens a response request would take",
            responses_bodies.ResponsesRequest,
            {200: {JSON: s.TokenCount}},
            {
                **GUARDED,
                **BODY,
                **ENGINE,
                **MODEL,
                404: "a model name this machine lacks, or a previous_response_id not stored",
            },
            [],
        ),
        (
            "get",
            "/v1/responses/{response_id}",
            "OpenAI Responses: a stored response",
            None,
            {200: {JSON: s.ResponseOut}},
            {**GUARDED, 404: "no such stored response (or expired)"},
            [_path("response_id", response_store.ID_PATTERN)],
        ),
        (
            "delete",
            "/v1/responses/{response_id}",
            "OpenAI Responses: forget a stored response",
            None,
            {200: {JSON: s.ResponseDeleted}},
            {**GUARDED, 404: "no such stored response (or expired)"},
            [_path("response_id", response_store.ID_PATTERN)],
        ),
        (
            "post",
            "/tokenize",
            "a text's or a conversation's token ids (a conversation as its chat request's prompt), their count",
            tokens.TokenizeRequest,
            {200: {JSON: s.Tokenized}},
            {**GUARDED, **BODY, **ENGINE, **MODEL},
            [],
        ),
        (
            "post",
            "/detokenize",
            "the text of token ids",
            tokens.DetokenizeRequest,
            {200: {JSON: s.Detokenized}},
            {**GUARDED, **BODY, **ENGINE, **MODEL},
            [],
        ),
        (
            "post",
            "/completion",
            "llama-server: a completion (streamed as server-sent events with stream: true)",
            llama.CompletionBody,
            {200: {JSON: s.LlamaCompletion, SSE: _events("a chunk of content, the last one with stop: true")}},
            gen,
            [],
        ),
        (
            "post",
            "/infill",
            "llama-server: fill in the middle, between input_prefix and input_suffix, in the model's own markers",
            llama.InfillBody,
            {200: {JSON: s.LlamaCompletion, SSE: _events("a chunk of content, the last one with stop: true")}},
            {**gen, 400: BODY[400] + "; a model without fill-in-the-middle tokens (naming input_suffix)"},
            [],
        ),
        (
            "post",
            "/v1/embeddings",
            "OpenAI: each input's embedding (the model's pooled hidden states, length 1), batched with the chats",
            embeddings.EmbeddingRequest,
            {200: {JSON: s.EmbeddingList}},
            gen,
            [],
        ),
        (
            "post",
            "/api/embed",
            "Ollama: each input's embedding (length 1); an input past the context is cut unless truncate is false",
            embeddings.OllamaEmbedRequest,
            {200: {JSON: s.OllamaEmbedAnswer}},
            olla_gen,
            [],
        ),
        (
            "post",
            "/api/embeddings",
            "Ollama (older): one prompt's embedding, not normalised",
            embeddings.OllamaEmbeddingsRequest,
            {200: {JSON: s.OllamaEmbeddingAnswer}},
            olla_gen,
            [],
        ),
        *(
            (
                "post",
                path,
                "documents ranked against a query by a reranker, best first (TEI's form and answer with `texts`)",
                rerank.RerankRequest,
                {200: {JSON: s.RerankOrTei}},
                {**gen, 400: BODY[400] + "; a model that is not a reranker (naming it and what it does)"},
                [],
            )
            for path in rerank.PATHS
        ),
        (
            "post",
            "/api/chat",
            "Ollama: a chat answer (streamed as NDJSON unless stream is false)",
            ollama.ChatBody,
            {200: {JSON: s.OllamaChatAnswer, NDJSON: {"type": "string"}}},
            olla_gen,
            [],
        ),
        (
            "post",
            "/api/generate",
            "Ollama: a completion (streamed as NDJSON unless stream is false)",
            ollama.GenerateBody,
            {200: {JSON: s.OllamaGenerateAnswer, NDJSON: {"type": "string"}}},
            olla_gen,
            [],
        ),
        (
            "get",
            "/api/tags",
            "Ollama: every model the daemon can serve",
            None,
            {200: {JSON: s.OllamaTags}},
            {**GUARDED},
            [],
        ),
        ("get", "/api/ps", "Ollama: the models loaded", None, {200: {JSON: s.OllamaPs}}, {**GUARDED}, []),
        (
            "post",
            "/api/show",
            "Ollama: the model's details",
            s.OllamaShowRequest,
            {200: {JSON: s.OllamaShow}},
            {**GUARDED, **BODY, **ENGINE, **MODEL},
            [],
        ),
        (
            "get",
            "/api/version",
            "Ollama: the API version followed",
            None,
            {200: {JSON: s.OllamaVersion}},
            {**GUARDED},
            [],
        ),
    ]


# pydantic writes a bound of `Int | None` (an integer type with a before-validator, inside a union) under
# its own keyword names; JSON Schema's are these.
_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def _json_schema_bounds(node):
    """A deep copy with JSON Schema's bound keywords, and every enum in one order (pydantic lists a
    Literal's values in set order, which differs between processes: the served document must be one)."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node = {_BOUNDS.get(k, k): v for k, v in node.items()}
        if isinstance(node.get("enum"), list):
            node = {**node, "enum": sorted(node["enum"], key=lambda v: (type(v).__name__, str(v)))}
        return {k: _json_schema_bounds(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_json_schema_bounds(v) for v in node]
    return node


def _schemas(models: list[tuple[type[BaseModel], str]]) -> tuple[dict, dict]:
    """(model and mode -> a $ref, the components' schemas)."""
    refs, defs = models_json_schema(models, ref_template=REF)
    return refs, _json_schema_bounds(defs.get("$defs", {}))


def document(model: str | None = None, vocab_size: int | None = None, version: str = "0.1.0") -> dict[str, Any]:
    """The document. What the daemon serves also states its facts: the `model` names a request may give, and
    the `vocab_size` every prompt token id is below."""
    ops = _operations()
    models: set[tuple[type[BaseModel], str]] = set()
    for _, _, _, body, answers, _, _ in ops:
        if body is not None:
            models.add((body, "validation"))
        for content in answers.values():
            models.update((m, "serialization") for m in content.values() if isinstance(m, type))
    models |= {
        (schemas.ErrorBody, "serialization"),
        (schemas.OllamaError, "serialization"),
        (schemas.AnthropicError, "serialization"),
    }
    refs, components = _schemas(sorted(models, key=lambda m: (m[0].__name__, m[1])))
    engine_info = _json_schema_bounds(TypeAdapter(EngineInfo).json_schema(ref_template=REF, mode="serialization"))
    engine_info["properties"].pop("model_dir")  # the API shows no server path (EngineInfo.as_dict(public=True))
    engine_info["required"].remove("model_dir")
    components.update(engine_info.pop("$defs", {}))
    components["EngineInfo"] = engine_info
    # Once the model is loaded /health carries the engine's facts beside its own fields.
    health = refs[(schemas.Health, "serialization")]["$ref"].rsplit("/", 1)[1]
    components[health] = {
        "allOf": [
            components[health],
            {"anyOf": [{"$ref": REF.format(model="EngineInfo")}, {"not": {"required": ["max_model_len"]}}]},
        ]
    }

    if model is not None:
        what = f"any model the daemon can serve (GET /v1/models, /api/tags), loaded on first use; left out: {model!r}"
        for body in {b for _, _, _, b, _, _, _ in ops if b is not None}:
            props = components[refs[(body, "validation")]["$ref"].rsplit("/", 1)[1]].get("properties", {})
            for key in ("model", "name") if body is schemas.OllamaShowRequest else ("model",):
                if key in props:
                    props[key] = {**props[key], "description": what}

    if vocab_size is not None:
        prompt = components[refs[(CompletionRequest, "validation")]["$ref"].rsplit("/", 1)[1]]["properties"]["prompt"]
        for variant in prompt["anyOf"]:
            items = variant.get("items", {})
            for ids in (items, items.get("items", {})):
                if ids.get("type") == "integer":
                    ids["maximum"] = vocab_size - 1
        for body in (embeddings.EmbeddingRequest, embeddings.OllamaEmbedRequest):
            name = refs[(body, "validation")]["$ref"].rsplit("/", 1)[1]
            for variant in components[name]["properties"]["input"]["anyOf"]:
                items = variant.get("items", {})
                for ids in (items, items.get("items", {})):
                    if ids.get("type") == "integer":
                        ids["maximum"] = vocab_size - 1
        detokenize = components[refs[(tokens.DetokenizeRequest, "validation")]["$ref"].rsplit("/", 1)[1]]
        detokenize["properties"]["tokens"]["items"]["maximum"] = vocab_size - 1

    def content(media: dict) -> dict:
        return {kind: {"schema": refs[(m, "serialization")] if isinstance(m, type) else m} for kind, m in media.items()}

    paths: dict[str, dict] = {}
    for method, path, summary, body, answers, errors, params in ops:
        shape = (
            schemas.OllamaError
            if path.startswith("/api/")
            else schemas.AnthropicError
            if path in anthropic.PATHS
            else schemas.ErrorBody
        )
        error = refs[(shape, "serialization")]
        responses = {str(code): {"description": "ok", "content": content(media)} for code, media in answers.items()}
        for code, why in errors.items():
            responses[str(code)] = {"description": why, "content": {JSON: {"schema": error}}}
        op: dict[str, Any] = {"summary": summary, "operationId": f"{method}{path}", "responses": responses}
        if body is not None:
            op["requestBody"] = {"required": True, "content": {JSON: {"schema": refs[(body, "validation")]}}}
        if params:
            op["parameters"] = params
        paths.setdefault(path, {})[method] = op
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "minibatch",
            "version": version,
            "description": "OpenAI-compatible, Ollama and native endpoints of the minibatch daemon, on its Unix "
            "socket and (with an API key) its TCP listener.",
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"}},
        },
        # The socket needs no key; the TCP listener needs one (or --insecure-no-auth).
        "security": [{}, {"apiKey": []}],
    }


def endpoint_table(doc: dict[str, Any] | None = None) -> str:
    """The Markdown table docs/api.md shows between its `<!-- endpoints -->` markers: every operation of the
    document with what it does, its query parameters and its body's fields (written from the document, so
    the page cannot drift from what the daemon validates; a test compares the two)."""
    doc = doc or document()
    components = doc["components"]["schemas"]
    rows = ["| method | path | what | query / body fields |", "|---|---|---|---|"]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            fields = [f"`?{p['name']}`" for p in op.get("parameters", []) if p.get("in") == "query"]
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            if "$ref" in body:
                props = components[body["$ref"].rsplit("/", 1)[1]].get("properties", {})
                fields += [f"`{name}`" for name in sorted(props)]
            summary = op.get("summary", "").replace("|", "\\|")
            rows.append(f"| {method.upper()} | `{path}` | {summary} | {', '.join(fields)} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # python -m minibatch.daemon.api.openapi: the document, or --markdown: the table
    import json
    import sys

    sys.stdout.write(endpoint_table() if "--markdown" in sys.argv[1:] else json.dumps(document(), indent=1) + "\n")

"""Reranking: `POST /v1/rerank` (and `/v1/reranking`, `/rerank`, as llama-server serves it) in the Jina and
Cohere shape, and Text Embeddings Inference's `POST /rerank` (`texts`), over the one pipeline.

A reranker is a cross-encoder (an encoder with a classification head: bge-reranker, ms-marco MiniLM): each
(query, document) pair is one input of the step, batched with whatever else runs, and its score is the head's
logit, as llama-server gives it (`relevance_score`); TEI's form gives its sigmoid unless `raw_scores`.
Results come best first; `top_n` keeps the first n. A document past the context is refused, naming it, unless
`truncate` is true: then its end is cut (the pair's closing separator kept).
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Annotated, Any

from aiohttp import web
from pydantic import ConfigDict, Field, StrictBool, StrictStr

from ..generation.pipeline import generate
from ..generation.spec import Generation
from ..protocol import ApiError, Int
from ..state import STATE, read_body
from .embeddings import MAX_INPUTS
from .messages import Body


class RerankDocument(Body):
    text: StrictStr = Field(min_length=1)


Text = Annotated[StrictStr, Field(min_length=1)]


class RerankRequest(Body):
    """Jina's and Cohere's body (llama-server's too), and TEI's (`texts`, `raw_scores`, `return_text`)."""

    # the documents come as one list or the other (a body with both or neither is a 400 naming them)
    model_config = ConfigDict(
        extra="forbid", strict=True, json_schema_extra={"oneOf": [{"required": ["documents"]}, {"required": ["texts"]}]}
    )

    model: StrictStr | None = None
    query: StrictStr = Field(min_length=1)
    documents: list[Text | RerankDocument] | None = Field(default=None, min_length=1, max_length=MAX_INPUTS)
    top_n: Int | None = Field(default=None, ge=1)  # and at most the documents given (checked with them)
    return_documents: StrictBool = False
    truncate: StrictBool = False  # a document past the context: cut at its end (false: a 400 naming it)
    # Text Embeddings Inference's form: `texts` instead of `documents`, answered as [{index, score, text?}]
    texts: list[Text] | None = Field(default=None, min_length=1, max_length=MAX_INPUTS)
    raw_scores: StrictBool = False
    return_text: StrictBool = False


def _texts(body: RerankRequest) -> tuple[list[str], str]:
    """(the documents' texts, the field they came in); neither list, both, or a top_n past them is a 400."""
    if body.documents is not None and body.texts is not None:
        msg = "texts: give the documents as `documents` or as TEI's `texts`, not both"
        raise ApiError(400, msg, "texts", "invalid_value")
    field = "documents" if body.documents is not None or body.texts is None else "texts"
    items = body.documents if field == "documents" else body.texts
    if not items:
        raise ApiError(400, f"{field}: at least one document is needed, got none", field, "invalid_value")
    texts = [d.text if isinstance(d, RerankDocument) else d for d in items]  # (each non-empty: the schema's)
    if body.top_n is not None and not 1 <= body.top_n <= len(texts):
        msg = f"top_n: must be between 1 and the {len(texts)} documents given, got {body.top_n}"
        raise ApiError(400, msg, "top_n", "invalid_value")
    return texts, field


async def _scores(request: web.Request, body: RerankRequest) -> tuple[list[str], list[float], int, str]:
    """(the texts, each one's score in their order, the tokens computed, the model's name)."""
    texts, field = _texts(body)
    gen = Generation(
        f"rerank-{uuid.uuid4().hex[:24]}",
        body.model,
        field,
        pairs=[(body.query, t) for t in texts],
        batch=True,
        embed=True,
        truncate=body.truncate,
    )
    async with generate(request.app[STATE], gen, request) as running:
        choices = await running.whole()
        return texts, [c.last.embedding[0] for c in choices], running.prompt_tokens, running.name


async def rerank(request: web.Request) -> web.Response:
    started = time.perf_counter()
    body = await read_body(request, request.app[STATE], RerankRequest)
    texts, scores, tokens, name = await _scores(request, body)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n or len(scores)]
    if body.texts is not None:  # TEI's answer: a list, sigmoid scores unless raw
        tei = []
        for i in order:
            item: dict[str, Any] = {"index": i, "score": scores[i] if body.raw_scores else _sigmoid(scores[i])}
            if body.return_text:
                item["text"] = texts[i]
            tei.append(item)
        return web.json_response(tei)
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return web.json_response(
        {
            "id": f"rerank-{uuid.uuid4().hex[:24]}",
            "object": "list",
            "model": name,
            "results": results,
            "usage": usage,
            "meta": {"duration_ms": round((time.perf_counter() - started) * 1000, 3)},
        }
    )


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


PATHS = ("/v1/rerank", "/v1/reranking", "/rerank")


def add_routes(app: web.Application) -> None:
    for path in PATHS:
        app.router.add_post(path, rerank)

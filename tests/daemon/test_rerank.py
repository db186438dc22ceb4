"""A retrieval setup against one daemon: a chat model, a BERT embedding model and an XLM-RoBERTa cross-encoder
served side by side by name (the real daemon over its socket, the openai SDK, the ollama client), their
vectors and scores against transformers on the same weights; /v1/rerank's and TEI's shapes; every refusal
names its field or the model and what it does, and the daemon keeps serving with no block left behind."""

from __future__ import annotations

import asyncio
import math
import shutil
import tempfile
from pathlib import Path

import httpx
import numpy as np
import ollama
import openai
import pytest
import torch
from make_encoder import save_bert, save_xlmr_reranker

from minibatch.daemon.client import request_json

from .helpers import Daemon, chat_body, session

QUERY = "what is a paged cache"
DOCS = [
    "the cat sat on the mat.",
    "a paged cache keeps the batch in blocks",
    "dog",
    "what is it about the time, when we get out",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("retrieval-models")
    save_bert(root / "minilm", pooling="mean")
    save_xlmr_reranker(root / "bge-reranker")
    return root


@pytest.fixture(scope="module")
def daemon(tiny_chat_model_dir, folder):
    d = tempfile.mkdtemp(prefix="mb-rr-", dir="/tmp")
    env = {"MINIBATCH_MODELS_DIR": str(folder)}
    daemon = Daemon(Path(d) / "d.sock", tiny_chat_model_dir, "--max-num-seqs", "8", "--kv-cache-gb", "0.05", env=env)
    daemon.wait_ready()
    yield daemon
    assert daemon.stop() == 0, daemon.log_text()
    shutil.rmtree(d, ignore_errors=True)


def call(daemon, path: str, body: dict) -> tuple[int, dict | list]:
    return request_json(str(daemon.socket), "POST", path, body, timeout=120)


def transformers_scores(path: Path) -> list[float]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return [float(hf(**tok(QUERY, d, return_tensors="pt")).logits[0, 0]) for d in DOCS]


def test_chat_embed_and_rerank_from_one_daemon_at_once(daemon, folder, tiny_chat_model_dir):
    """The three models answer concurrently, each by its name; the vectors are transformers' mean-pooled last
    hidden states (length 1), the scores its cross-encoder's logits, best first."""
    import transformers

    async def together():
        async with session(daemon.socket) as s:
            chat = s.post("/v1/chat/completions", json=chat_body("hello", model=tiny_chat_model_dir.name, max_tokens=4))
            embed = s.post("/v1/embeddings", json={"model": "minilm", "input": DOCS})
            rank = s.post("/v1/rerank", json={"model": "bge-reranker", "query": QUERY, "documents": DOCS})
            out = []
            for r in await asyncio.gather(chat, embed, rank):
                assert r.status == 200, await r.text()
                out.append(await r.json())
            return out

    chat, embed, rank = asyncio.run(together())
    assert chat["choices"][0]["message"]["content"] is not None
    tok = transformers.AutoTokenizer.from_pretrained(folder / "minilm")
    hf = transformers.AutoModel.from_pretrained(folder / "minilm").eval()
    for item, text in zip(embed["data"], DOCS):
        with torch.no_grad():
            want = hf(**tok(text, return_tensors="pt")).last_hidden_state[0].double().mean(0).numpy()
        assert np.abs(np.asarray(item["embedding"]) - want / np.linalg.norm(want)).max() < 1e-5
    want = transformers_scores(folder / "bge-reranker")
    assert [r["index"] for r in rank["results"]] == sorted(range(len(DOCS)), key=lambda i: -want[i])
    assert max(abs(r["relevance_score"] - want[r["index"]]) for r in rank["results"]) < 1e-4
    assert rank["model"] == "bge-reranker" and rank["usage"]["prompt_tokens"] == rank["usage"]["total_tokens"] > 0
    # the SDK and the ollama client reach the embedding model by name too
    transport = httpx.HTTPTransport(uds=str(daemon.socket))
    client = openai.OpenAI(base_url="http://localhost/v1", api_key="-", http_client=httpx.Client(transport=transport))
    sdk = client.embeddings.create(model="minilm", input=DOCS[1], encoding_format="float").data[0].embedding
    assert np.abs(np.asarray(sdk) - np.asarray(embed["data"][1]["embedding"])).max() < 1e-6
    olla = ollama.Client(host="http://localhost", transport=transport).embed(model="minilm", input=DOCS[1])
    assert np.abs(np.asarray(olla.embeddings[0]) - np.asarray(sdk)).max() < 1e-6
    assert ollama.Client(host="http://localhost", transport=transport).show("minilm").capabilities == ["embedding"]
    # `dimensions` keeps a vector's first values, normalised again (OpenAI's and Ollama's Matryoshka cut)
    short = client.embeddings.create(model="minilm", input=DOCS[1], encoding_format="float", dimensions=16)
    head = np.asarray(sdk[:16])
    assert np.abs(np.asarray(short.data[0].embedding) - head / np.linalg.norm(head)).max() < 1e-6
    cut = ollama.Client(host="http://localhost", transport=transport).embed(
        model="minilm", input=DOCS[1], dimensions=16
    )
    assert np.abs(np.asarray(cut.embeddings[0]) - np.asarray(short.data[0].embedding)).max() < 1e-6


def test_top_n_documents_and_the_tei_form(daemon):
    body = {"model": "bge-reranker", "query": QUERY}
    status, full = call(daemon, "/v1/rerank", {**body, "documents": DOCS})
    assert status == 200
    status, top = call(
        daemon,
        "/v1/reranking",
        {**body, "documents": [{"text": d} for d in DOCS], "top_n": 2, "return_documents": True},
    )
    assert status == 200 and [r["index"] for r in top["results"]] == [r["index"] for r in full["results"][:2]]
    assert [r["document"]["text"] for r in top["results"]] == [DOCS[r["index"]] for r in top["results"]]
    assert "document" not in full["results"][0]
    status, tei = call(daemon, "/rerank", {**body, "texts": DOCS, "return_text": True})
    assert status == 200 and isinstance(tei, list)
    logits = {r["index"]: r["relevance_score"] for r in full["results"]}
    assert [t["index"] for t in tei] == [r["index"] for r in full["results"]]
    for t in tei:
        assert abs(t["score"] - 1 / (1 + math.exp(-logits[t["index"]]))) < 1e-6 and t["text"] == DOCS[t["index"]]
    status, raw = call(daemon, "/rerank", {**body, "texts": DOCS, "raw_scores": True})
    assert status == 200 and [t["score"] for t in raw] == [r["relevance_score"] for r in full["results"]]


def test_refusals_name_the_field_or_the_model_and_leave_nothing_behind(daemon, tiny_chat_model_dir):
    chat_model, long_doc = tiny_chat_model_dir.name, "the " * 200
    cases = [
        ("/v1/rerank", {"model": "bge-reranker", "query": QUERY, "documents": []}, "documents", "at least 1 item"),
        ("/v1/rerank", {"model": "bge-reranker", "query": QUERY}, "documents", "at least one"),
        ("/v1/rerank", {"model": "bge-reranker", "query": QUERY, "documents": ["a", ""]}, "documents.1", "1 char"),
        ("/v1/rerank", {"model": "bge-reranker", "query": QUERY, "documents": DOCS, "top_n": 0}, "top_n", "equal to 1"),
        (
            "/v1/rerank",
            {"model": "bge-reranker", "query": QUERY, "documents": DOCS, "top_n": 5},
            "top_n",
            "4 documents",
        ),
        ("/rerank", {"model": "bge-reranker", "query": QUERY, "documents": DOCS, "texts": DOCS}, "texts", "not both"),
        ("/v1/rerank", {"model": "bge-reranker", "query": QUERY, "documents": ["a", long_doc]}, "documents.1", "limit"),
        ("/v1/rerank", {"model": "bge-reranker", "query": "", "documents": ["a"]}, "query", ""),
        ("/v1/rerank", {"model": chat_model, "query": QUERY, "documents": DOCS}, "model", "cannot rerank"),
        ("/v1/rerank", {"model": "minilm", "query": QUERY, "documents": DOCS}, "model", "it can embed"),
        ("/v1/embeddings", {"model": "bge-reranker", "input": "a"}, "model", "cannot embed: it can rerank"),
        ("/v1/chat/completions", chat_body("hi", model="minilm"), "model", "cannot generate text"),
    ]
    for path, body, param, words in cases:
        status, answer = call(daemon, path, body)
        assert status == 400 and answer["error"]["param"] == param, (path, body.get("model"), answer)
        assert words in answer["error"]["message"], answer
    status, cut = call(
        daemon, "/v1/rerank", {"model": "bge-reranker", "query": QUERY, "documents": ["a", long_doc], "truncate": True}
    )
    assert status == 200 and len(cut["results"]) == 2  # the long document cut to the context, scored
    for name in ("bge-reranker", "minilm"):
        status, stats = request_json(str(daemon.socket), "GET", f"/v1/engine/stats?model={name}")
        assert status == 200 and stats["kv_blocks_used"] == 0 and stats["running"] == 0, stats
    status, health = request_json(str(daemon.socket), "GET", "/health")
    assert status == 200 and health["tasks"] == ["generate", "embed"]

"""Retrieval throughput: embedding passages with an encoder (BERT-base's shape) and reranking documents against a
query with a cross-encoder (an XLM-RoBERTa reranker of BERT-base's size), on minibatchd and then on llama.cpp's
llama-server (`--embeddings --pooling mean`, `--rerank`) with the same GGUF files and threads, one server at a
time. The files are made by scripts/dev/make_encoder.py when not given; the passages are --words words of
common English (each word one token of their vocabulary, so ~--words + 2 tokens).

Embeddings: --passages passages, --batch per request, --clients requests at a time: passages/s and tokens/s.
Reranking: --queries requests of --documents documents each, --clients at a time: documents/s. The servers'
answers are compared too: the cosine of each passage's two vectors, and whether the rerank orders agree.

  .venv/bin/python scripts/features/bench_retrieval.py [--passages 128] [--documents 100] [--llama-server PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from loadgen import session  # noqa: E402
from peers import Launch, Running, llamacpp  # noqa: E402
from peers import minibatch as ours  # noqa: E402
from peers.compare import wait_ready  # noqa: E402

DEV = Path(__file__).resolve().parents[1] / "dev"
sys.path.insert(0, str(DEV))
from make_encoder import WORDS  # noqa: E402


def passages(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def model_file(given: Path | None, shape: str, cache: Path) -> Path:
    """The GGUF to serve: the one given, else a random one of `shape`, written once under `cache`."""
    if given is not None:
        return given
    out = cache / f"bench-{shape}"
    gguf = out.with_suffix(".gguf")
    if not gguf.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(DEV / "make_encoder.py"), "--shape", shape, "--out", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return gguf


async def embed(target: dict, texts: list[str], batch: int, clients: int, model: str | None) -> tuple[dict, list]:
    """Every passage once, `batch` a request, `clients` requests at a time: the rate and the vectors."""
    jobs = [list(range(i, min(i + batch, len(texts)))) for i in range(0, len(texts), batch)]
    vectors: list = [None] * len(texts)
    tokens = 0

    async def client(s) -> None:
        nonlocal tokens
        while jobs:
            idx = jobs.pop(0)
            body = {"input": [texts[i] for i in idx], "encoding_format": "float", **({"model": model} if model else {})}
            async with s.post("/v1/embeddings", json=body) as r:
                answer = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"embeddings: {r.status} {answer}")
                tokens += answer["usage"]["prompt_tokens"]
                for i, item in zip(idx, answer["data"]):
                    vectors[i] = item["embedding"]

    async with session(**target) as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(s) for _ in range(clients)))
        wall = time.perf_counter() - t0
    rate = {"passages_s": round(len(texts) / wall, 2), "tokens_s": round(tokens / wall, 1), "seconds": round(wall, 2)}
    return rate, vectors


async def rerank(target: dict, query: str, docs: list[str], requests: int, clients: int, model: str | None) -> tuple:
    """`requests` rerank requests of every document, `clients` at a time: documents/s and the last order."""
    left, order = list(range(requests)), []

    async def client(s) -> None:
        nonlocal order
        while left:
            left.pop()
            body = {"query": query, "documents": docs, **({"model": model} if model else {})}
            async with s.post("/v1/rerank", json=body) as r:
                answer = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"rerank: {r.status} {answer}")
                order = [(x["index"], x["relevance_score"]) for x in answer["results"]]

    async with session(**target) as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(s) for _ in range(clients)))
        wall = time.perf_counter() - t0
    return {"documents_s": round(requests * len(docs) / wall, 2), "seconds": round(wall, 2)}, order


async def side(name: str, launch: Launch, target: dict, work: Path, fn, *args):
    running = Running(launch, work / f"{name}.log")
    try:
        await wait_ready(running, target)
        await fn(target, *args)  # warm-up (the same work: both servers see it once before it counts)
        return await fn(target, *args)
    finally:
        running.stop()


def launches(args, gguf: Path, work: Path, kind: str, port: int) -> list[tuple[str, Launch, dict]]:
    sock = str(work / f"mb-{kind}.sock")
    mine = ours.launch(sock, "native", args.clients * args.batch, args.threads, str(gguf))
    out = [("minibatch", mine, {"socket": sock})]
    exe = args.exe
    if exe is not None:
        flags = ["--embeddings", "--pooling", "mean"] if kind == "embed" else ["--rerank"]
        argv = llamacpp.command(exe, gguf, port, args.clients, args.threads, 512 * max(1, args.batch))
        argv += [*flags, "-ub", "4096", "-b", "4096"]
        url = f"http://127.0.0.1:{port}"
        out.append(("llama.cpp", Launch(name="llama.cpp", argv=argv, url=url, model="x"), {"url": url}))
    return out


def cosine(a: list[float], b: list[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b))
    return dot / math.sqrt(math.fsum(x * x for x in a) * math.fsum(y * y for y in b))


async def main_async(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="mb-rtv-", dir="/tmp"))
    cache = Path(args.cache)
    embed_gguf = model_file(args.embed_model, "bert-base", cache)
    rank_gguf = model_file(args.rerank_model, "bge-reranker-base", cache)
    texts = passages(args.passages, args.words, args.seed)
    docs = passages(args.documents, args.doc_words, args.seed + 1)
    query = " ".join(random.Random(args.seed + 2).choice(WORDS) for _ in range(12))
    report: dict = {"threads": args.threads, "clients": args.clients, "batch": args.batch, "embed": {}, "rerank": {}}
    vectors, orders = {}, {}
    for name, launch, target in launches(args, embed_gguf, work, "embed", args.port):
        rate, vectors[name] = await side(
            f"{name}-embed", launch, target, work, embed, texts, args.batch, args.clients, launch.model
        )
        report["embed"][name] = rate
    for name, launch, target in launches(args, rank_gguf, work, "rerank", args.port + 1):
        rate, orders[name] = await side(
            f"{name}-rerank", launch, target, work, rerank, query, docs, args.queries, args.clients, launch.model
        )
        report["rerank"][name] = rate
    if "llama.cpp" in vectors:
        cos = [cosine(a, b) for a, b in zip(vectors["minibatch"], vectors["llama.cpp"])]
        report["embed"]["cosine_min"] = round(min(cos), 7)
        ours_order = [i for i, _ in orders["minibatch"]]
        theirs = dict(orders["llama.cpp"])
        report["rerank"]["same_order"] = ours_order == [i for i, _ in orders["llama.cpp"]]
        report["rerank"]["score_diff_max"] = round(max(abs(s - theirs[i]) for i, s in orders["minibatch"]), 6)
        report["llama.cpp"] = llamacpp.server_version(args.exe)
    shutil.rmtree(work, ignore_errors=True)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--embed-model", type=Path, default=None, help="an encoder GGUF (default: BERT-base's shape)")
    ap.add_argument("--rerank-model", type=Path, default=None, help="a reranker GGUF (default: bge-reranker-base's)")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/minibatch/bench-models"))
    ap.add_argument("--passages", type=int, default=128)
    ap.add_argument("--words", type=int, default=198, help="words a passage (~200 tokens)")
    ap.add_argument("--batch", type=int, default=8, help="passages a request")
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--documents", type=int, default=100)
    ap.add_argument("--doc-words", type=int, default=64)
    ap.add_argument("--queries", type=int, default=2, help="rerank requests, each of every document")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llama-server", default=None, help="llama-server binary (else $LLAMA_SERVER or PATH)")
    ap.add_argument("--port", type=int, default=18951)
    ap.add_argument("--json", type=Path, default=Path("results/bench_retrieval.json"))
    args = ap.parse_args()
    found = args.llama_server or os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    args.exe = llamacpp.find_server(args.llama_server) if found else None
    report = asyncio.run(main_async(args))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print("| server | passages/s | tokens/s | rerank documents/s |\n|---|---:|---:|---:|")
    for name in ("minibatch", "llama.cpp"):
        if name in report["rerank"]:
            e, r = report["embed"][name], report["rerank"][name]
            print(f"| {name} | {e['passages_s']} | {e['tokens_s']} | {r['documents_s']} |")
    if "llama.cpp" in report["rerank"]:
        ratio_e = report["embed"]["minibatch"]["passages_s"] / report["embed"]["llama.cpp"]["passages_s"]
        ratio_r = report["rerank"]["minibatch"]["documents_s"] / report["rerank"]["llama.cpp"]["documents_s"]
        print(
            f"minibatch / llama.cpp: embeddings {ratio_e:.2f}x, rerank {ratio_r:.2f}x; vectors' cosine >= "
            f"{report['embed']['cosine_min']}, rerank order the same: {report['rerank']['same_order']}"
        )


if __name__ == "__main__":
    main()

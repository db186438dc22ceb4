"""Embeddings throughput: inputs/s at --clients concurrent clients (texts of 32 to 512 tokens), alone and beside
a chat load, with the chats' time per output token alone and beside; then the same inputs against llama.cpp's
llama-server --embeddings on the same GGUF (the built-in model; last-token pooling on both), one server at a
time, both on --threads threads.

  .venv/bin/python scripts/features/bench_embeddings.py [--clients 16] [--inputs 96] [--chats 4] [--llama-server PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from loadgen import session  # noqa: E402
from peers import Launch, Running, llamacpp  # noqa: E402
from peers import minibatch as ours  # noqa: E402
from peers.compare import wait_ready  # noqa: E402

from minibatch.engine.store.cache import BUILTIN_MODELS, DEFAULT_MODEL, builtin_gguf_path  # noqa: E402

WORDS = "the a batch of tokens runs on two cores while paged blocks hold each request's keys and values".split()


def texts(n: int, lo: int, hi: int, seed: int) -> list[str]:
    """n texts of lo..hi words (about as many tokens: these words are one token each, with their space)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


async def embed_all(target: dict, inputs: list[str], clients: int, model: str | None) -> dict:
    """Every input once, `clients` at a time, one input a request: inputs/s and prompt tokens/s."""
    queue = list(enumerate(inputs))
    tokens = 0

    async def client(s) -> None:
        nonlocal tokens
        while queue:
            _, text = queue.pop()
            body = {"input": text, **({"model": model} if model else {})}
            async with s.post("/v1/embeddings", json=body) as r:
                answer = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"embeddings: {r.status} {answer}")
                tokens += answer["usage"]["prompt_tokens"]

    async with session(**target) as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(s) for _ in range(clients)))
        wall = time.perf_counter() - t0
    return {
        "inputs": len(inputs),
        "seconds": round(wall, 2),
        "inputs_s": round(len(inputs) / wall, 2),
        "tokens_s": round(tokens / wall, 1),
    }


async def chats(target: dict, n: int, tokens: int, stop: asyncio.Event) -> list[float]:
    """n clients asking for `tokens` forced tokens again and again until `stop`: each answer's time per output
    token after the first (ms)."""
    tpots: list[float] = []

    async def client(s, i: int) -> None:
        while not stop.is_set():
            body = {
                "messages": [{"role": "user", "content": f"Tell me about the number {i}."}],
                "max_tokens": tokens,
                "ignore_eos": True,
            }
            async with s.post("/v1/chat/completions", json=body) as r:
                answer = await r.json()
                tpots.append(answer["minibatch"]["tpot_ms"])

    async with session(**target) as s:
        await asyncio.gather(*(client(s, i) for i in range(n)))
    return tpots


async def minibatch_side(args, inputs: list[str], workdir: Path) -> dict:
    sock = str(workdir / "mb.sock")
    running = Running(
        ours.launch(sock, "native", max(args.clients, args.chats), args.threads, args.model), workdir / "mb.log"
    )
    target = {"socket": sock}
    try:
        await wait_ready(running, target)
        await embed_all(target, inputs[: args.clients], args.clients, None)  # warm-up
        alone = await embed_all(target, inputs, args.clients, None)
        stop = asyncio.Event()
        chat_alone = asyncio.ensure_future(chats(target, args.chats, args.chat_tokens, stop))
        await asyncio.sleep(args.chat_seconds)
        stop.set()
        tpot_alone = await chat_alone
        stop = asyncio.Event()
        chat_beside = asyncio.ensure_future(chats(target, args.chats, args.chat_tokens, stop))
        await asyncio.sleep(1.0)  # the chats are decoding
        beside = await embed_all(target, inputs, args.clients, None)
        stop.set()
        tpot_beside = await chat_beside
    finally:
        running.stop()
    return {
        "alone": alone,
        "beside_chats": beside,
        "chat_tpot_ms_alone": round(statistics.median(tpot_alone), 1),
        "chat_tpot_ms_beside": round(statistics.median(tpot_beside), 1),
        "chat_answers": [len(tpot_alone), len(tpot_beside)],
    }


async def llama_side(args, inputs: list[str], workdir: Path) -> dict:
    exe = llamacpp.find_server(args.llama_server)
    source = builtin_gguf_path(BUILTIN_MODELS[DEFAULT_MODEL])
    argv = llamacpp.command(exe, source, args.port, args.clients, args.threads, 1024)
    argv += ["--embeddings", "--pooling", "last", "-ub", "2048", "-b", "2048"]
    launch = Launch(name="llama.cpp", argv=argv, url=f"http://127.0.0.1:{args.port}")
    running = Running(launch, workdir / "llama.log")
    target = {"url": launch.url}
    try:
        await wait_ready(running, target)
        await embed_all(target, inputs[: args.clients], args.clients, "x")
        result = await embed_all(target, inputs, args.clients, "x")
    finally:
        running.stop()
    return {"alone": result, "version": llamacpp.server_version(exe)}


async def main_async(args) -> dict:
    inputs = texts(args.inputs, 32, 512, args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="mb-emb-", dir="/tmp"))
    report = {"clients": args.clients, "inputs": args.inputs, "chats": args.chats, "threads": args.threads}
    report["minibatch"] = await minibatch_side(args, inputs, workdir)
    if args.llama_server or os.environ.get("LLAMA_SERVER") or shutil.which("llama-server"):
        report["llama.cpp"] = await llama_side(args, inputs, workdir)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--inputs", type=int, default=96, help="texts of 32-512 words, each embedded once a run")
    ap.add_argument("--chats", type=int, default=4, help="chat clients beside the embeddings")
    ap.add_argument("--chat-tokens", type=int, default=48)
    ap.add_argument("--chat-seconds", type=float, default=20.0, help="the chats alone, for their TPOT")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llama-server", default=None, help="llama-server binary (else $LLAMA_SERVER or PATH)")
    ap.add_argument("--port", type=int, default=18933)
    ap.add_argument("--json", type=Path, default=Path("results/bench_embeddings.json"))
    args = ap.parse_args()
    report = asyncio.run(main_async(args))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    mb = report["minibatch"]
    print("| server | setting | inputs/s | prompt tokens/s |\n|---|---|---:|---:|")
    print(f"| minibatch | alone | {mb['alone']['inputs_s']} | {mb['alone']['tokens_s']} |")
    beside = mb["beside_chats"]
    print(f"| minibatch | beside {args.chats} chats | {beside['inputs_s']} | {beside['tokens_s']} |")
    if "llama.cpp" in report:
        lc = report["llama.cpp"]["alone"]
        print(f"| llama.cpp | alone | {lc['inputs_s']} | {lc['tokens_s']} |")
    print(f"chat TPOT: {mb['chat_tpot_ms_alone']} ms alone, {mb['chat_tpot_ms_beside']} ms beside the embeddings")


if __name__ == "__main__":
    main()

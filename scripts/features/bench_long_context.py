"""Long prompts, one request at a time: prefill and decode tokens per second and RSS, minibatchd per KV cache type
beside llama-server with the same GGUF (its default f16 cache, and its q8_0 cache with -fa).

  .venv/bin/python scripts/features/bench_long_context.py --gguf models/qwen05b-q4km.gguf \\
      --llama-server /path/to/llama-server --lengths 1024,8192,16384 --types q8_0,f16,f32
  .venv/bin/python scripts/features/bench_long_context.py --lengths 1024,4096     # the built-in model, minibatchd alone

Each server runs alone (two would share the cores), with a pool of --ctx tokens, --threads threads, no prefix
reuse between requests: every prompt starts with a fresh random tag; minibatchd without speculation (drafts
looked up in a repeated text would measure speculation, not the cache). For each length: one request of that
many prompt tokens (the built-in text, repeated) and --max-tokens greedy tokens (ignore_eos), streamed;
prefill tok/s = prompt tokens / the time to the first token, decode tok/s = the output tokens after the first
over the time they took, each by the server's own timings (minibatchd's `minibatch` field, llama-server's
`timings`). RSS: the server process's, after the longest prompt. Median of --repeats requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import aiohttp  # noqa: E402

TEXT = Path(__file__).resolve().parents[1] / "data" / "hamlet.txt"


def prompt_of(tokenizer, length: int, rng: random.Random) -> str:
    """About `length` tokens: a random tag, then the text repeated, cut at `length` tokens."""
    ids = tokenizer.encode(TEXT.read_text())
    tag = f"[{rng.randrange(10**12):012d}] "
    body = (ids * (length // len(ids) + 1))[: length - len(tokenizer.encode(tag))]
    return tag + tokenizer.decode(body)


async def one(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, float, int]:
    """(prefill tok/s, decode tok/s, prompt tokens) of one streamed request, by the server's own clock: minibatchd's
    `minibatch` timings (time to the first token, then per output token), llama-server's `timings` (prompt eval,
    then per predicted token). A random-weight model's tokens are often special ones whose text is empty and
    which a server need not stream, so the client's clock cannot see each token."""
    prompt_tokens, mine, theirs, error = 0, None, None, None
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise SystemExit(f"{url}: {resp.status} {await resp.text()}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            prompt_tokens = (chunk.get("usage") or {}).get("prompt_tokens", prompt_tokens)
            mine = chunk.get("minibatch") or mine
            theirs = chunk.get("timings") or theirs
            error = chunk.get("error") or error
    if error:
        raise SystemExit(f"{url}: {error}")
    if mine:
        return prompt_tokens / (mine["ttft_ms"] / 1e3), 1e3 / mine["tpot_ms"], prompt_tokens
    if theirs:
        return theirs["prompt_per_second"], theirs["predicted_per_second"], theirs["prompt_n"]
    raise SystemExit(f"{url}: the answer carried no timings")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def wait_ready(check, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("server did not become ready")


async def measure(url: str, socket: str | None, lengths, prompts, args, model: str | None) -> list[dict]:
    rows = []
    # a new connection per request: llama-server closes a streamed one when it ends
    connector = aiohttp.UnixConnector(path=socket) if socket else aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        warm = {"prompt": "hello", "max_tokens": 4, "temperature": 0, "stream": True}
        await one(session, url, warm | ({"model": model} if model else {}))
        for n in lengths:
            runs = []
            for r in range(args.repeats):
                body = {
                    "prompt": prompts[n][r],
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                if model:
                    body["model"] = model
                runs.append(await one(session, url, body))
            prefill = statistics.median(r[0] for r in runs)
            decode = statistics.median(r[1] for r in runs)
            rows.append({"length": n, "prompt_tokens": runs[0][2], "prefill": prefill, "decode": decode})
            print(f"  {n}: prefill {prefill:.1f} tok/s, decode {decode:.1f} tok/s", flush=True)
    return rows


def run_minibatch(kv_type: str, args, lengths, prompts) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="mb-long-"))
    sock = str(workdir / "mb.sock")
    daemon = str(Path(sys.executable).parent / "minibatchd")
    argv = [
        daemon,
        "start",
        "--socket",
        sock,
        "--model",
        str(args.gguf),
        "--threads",
        str(args.threads),
        "--max-num-seqs",
        "1",
        "--kv-cache-tokens",
        str(args.ctx),
        "--max-model-len",
        str(args.ctx),
        "--kv-cache-type",
        kv_type,
        "--no-prefix-caching",
        "--speculative",
        "off",
        "--request-timeout",
        "7200",
    ]  # fmt: skip  (a 32k prompt's prefill on two cores takes past 600 s)
    subprocess.run(argv, check=True, capture_output=True, timeout=900)
    try:
        from minibatch.daemon.lifecycle import running_pid

        pid = running_pid(Path(sock))
        print(f"minibatchd --kv-cache-type {kv_type} (pid {pid})", flush=True)
        rows = asyncio.run(measure("http://localhost/v1/completions", sock, lengths,
                                   prompts, args, None))  # fmt: skip
        return {"server": f"minibatchd {kv_type}", "rows": rows, "rss_mb": rss_mb(pid)}
    finally:
        subprocess.run([daemon, "stop", "--socket", sock], capture_output=True, timeout=120)


def run_llama(kv_type: str, args, lengths, prompts) -> dict:
    port = free_port()
    argv = [args.llama_server, "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port), "-t",
            str(args.threads), "-tb", str(args.threads), "-np", "1", "-c", str(args.ctx), "--no-webui",
            "--cache-reuse", "0", "-ctk", kv_type, "-ctv", kv_type]  # fmt: skip
    if kv_type != "f16":
        argv.append("-fa")  # a quantized V cache needs flash attention in llama.cpp
    log = open(Path(tempfile.gettempdir()) / f"llama-long-{kv_type}.log", "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        import urllib.request

        wait_ready(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200)
        print(f"llama-server -ctk/-ctv {kv_type}{' -fa' if kv_type != 'f16' else ''} (pid {proc.pid})", flush=True)
        rows = asyncio.run(measure(f"http://127.0.0.1:{port}/v1/completions", None, lengths, prompts, args, None))
        return {"server": f"llama-server {kv_type}{' -fa' if kv_type != 'f16' else ''}", "rows": rows,
                "rss_mb": rss_mb(proc.pid)}  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=None, help="the model file both servers load (default: the built-in)")
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    ap.add_argument("--lengths", default="1024,8192,16384")
    ap.add_argument("--types", default="q8_0,f16", help="minibatchd's KV cache types")
    ap.add_argument("--llama-types", default="f16,q8_0", help="llama-server's (-ctk/-ctv; q8_0 runs with -fa)")
    ap.add_argument("--ctx", type=int, default=0, help="pool tokens (default: the longest prompt + 256)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args(argv)
    from minibatch.engine.store.cache import BUILTIN_MODELS, DEFAULT_MODEL, builtin_gguf_path, resolve_model
    from minibatch.engine.text.tokenizer import TextTokenizer

    args.gguf = args.gguf or builtin_gguf_path(BUILTIN_MODELS[DEFAULT_MODEL])
    lengths = [int(x) for x in args.lengths.split(",")]
    args.ctx = args.ctx or max(lengths) + 256
    tokenizer = TextTokenizer(resolve_model(str(args.gguf)))
    rng = random.Random(0)
    prompts = {n: [prompt_of(tokenizer, n, rng) for _ in range(args.repeats)] for n in lengths}
    results = [run_minibatch(t, args, lengths, prompts) for t in args.types.split(",") if t]
    if args.llama_server:
        results += [run_llama(t, args, lengths, prompts) for t in args.llama_types.split(",") if t]
    print("\n| server | " + " | ".join(f"{n} prefill / decode tok/s" for n in lengths) + " | RSS MB |")
    print("|---|" + "---:|" * (len(lengths) + 1))
    for r in results:
        cells = [f"{row['prefill']:.1f} / {row['decode']:.1f}" for row in r["rows"]]
        print(f"| {r['server']} | " + " | ".join(cells) + f" | {r['rss_mb']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

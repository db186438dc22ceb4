"""LoRA adapters, several in one batch: --clients clients spread over --adapters adapters (each client its own
adapter and scale, llama-server's per-request `lora` list) against the same clients on the base model alone,
on minibatchd and then on llama.cpp's llama-server, with the same GGUF files and threads, one server at a time.

The base model is a random model of --shape (scripts/dev/make_model.py, the named model's own vocabulary,
quantized --quantize) unless --model gives one; the adapters are random rank---rank adapters on every projection
(q, k, v, o, gate, up, down), written as llama.cpp's convert_lora_to_gguf.py writes them, so both servers load
the same files. Each client sends --requests completions of --tokens tokens one after another (sampled with
llama-server's defaults unless --greedy; to the end, ignoring EOS), every request `/completion` with its `lora`
list, so both servers do the same work. Tokens/s is every generated token over the phase's wall time, the
median of --repeats runs, the base and the adapter phases alternating.

  .venv/bin/python scripts/features/bench_lora.py [--shape qwen2.5-0.5b] [--clients 16] [--llama-server PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
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
from make_model import SHAPES, write_lora  # noqa: E402

SCALES = (1.0, 0.75, 0.5, 1.25)  # the clients' scales, by adapter
SAMPLED = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}  # llama-server's defaults


def model_file(args, cache: Path) -> Path:
    """The base GGUF: the one given, else a random one of --shape written once under `cache`."""
    if args.model is not None:
        return args.model
    out = cache / f"lora-base-{args.shape}-{args.quantize.lower()}.gguf"
    if not out.is_file():
        cmd = [sys.executable, str(DEV / "make_model.py"), "--shape", args.shape, "--true-vocab", "--out", str(out)]
        subprocess.run([*cmd, "--quantize", args.quantize], check=True, stdout=subprocess.DEVNULL)
    return out


def body(client: int, request: int, args, adapters: bool) -> dict:
    words = f"Request {request} of client {client}: write a long story about a lighthouse keeper and the sea."
    ask = {"prompt": words, "n_predict": args.tokens, "ignore_eos": True, "cache_prompt": False, "stream": False}
    ask |= {"temperature": 0.0} if args.greedy else {**SAMPLED, "seed": 1000 * client + request}
    if adapters:
        k = client % args.adapters
        ask["lora"] = [{"id": k, "scale": SCALES[k % len(SCALES)]}]
    return ask


async def phase(target: dict, args, adapters: bool) -> float:
    """Every client's requests, one after another each, all clients at once: generated tokens/s."""
    tokens = 0

    async def client(s, c: int) -> None:
        nonlocal tokens
        for r in range(args.requests):
            async with s.post("/completion", json=body(c, r, args, adapters)) as resp:
                answer = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"/completion: {resp.status} {answer}")
                tokens += answer["tokens_predicted"]

    async with session(**target) as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(s, c) for c in range(args.clients)))
        return tokens / (time.perf_counter() - t0)


async def side(name: str, launch: Launch, target: dict, work: Path, args) -> dict:
    running = Running(launch, work / f"{name}.log")
    try:
        await wait_ready(running, target)
        await phase(target, args, True)  # warm-up: the same work, seen once before it counts
        base, mixed = [], []
        for _ in range(args.repeats):
            base.append(await phase(target, args, False))
            mixed.append(await phase(target, args, True))
        b, m = statistics.median(base), statistics.median(mixed)
        return {"base_tokens_s": round(b, 1), "adapters_tokens_s": round(m, 1), "adapters_over_base": round(m / b, 3)}
    finally:
        running.stop()


def launches(args, gguf_path: Path, adapters: list[Path], work: Path) -> list[tuple[str, Launch, dict]]:
    sock = str(work / "mb.sock")
    mine = ours.launch(sock, "native", args.clients, args.threads, str(gguf_path))
    mine.argv += ["--lora", ",".join(f"a{k}={p}" for k, p in enumerate(adapters)), "--speculative", "off"]
    out = [("minibatch", mine, {"socket": sock})]
    if args.exe is not None:
        argv = llamacpp.command(args.exe, gguf_path, args.port, args.clients, args.threads, 512)
        for p in adapters:
            argv += ["--lora", str(p)]
        argv += ["--lora-init-without-apply"]  # requests without a list run the base, as ours do
        url = f"http://127.0.0.1:{args.port}"
        out.append(("llama.cpp", Launch(name="llama.cpp", argv=argv, url=url), {"url": url}))
    return out


async def main_async(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="mb-lora-", dir="/tmp"))
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    base = model_file(args, cache)
    adapters = []
    for k in range(args.adapters):
        path = cache / f"lora-{args.shape}-r{args.rank}-{k}.gguf"
        adapters.append(path if path.is_file() else write_lora(path, args.shape, args.rank, k))
    report: dict = {
        "model": base.name,
        "adapters": args.adapters,
        "rank": args.rank,
        "clients": args.clients,
        "tokens": args.tokens,
        "requests": args.requests,
        "sampling": "greedy" if args.greedy else "sampled",
        "threads": args.threads,
    }
    for name, launch, target in launches(args, base, adapters, work):
        report[name] = await side(name, launch, target, work, args)
    if args.exe is not None:
        report["llama.cpp"]["version"] = llamacpp.server_version(args.exe)
        report["minibatch_over_llama_cpp"] = round(
            report["minibatch"]["adapters_tokens_s"] / report["llama.cpp"]["adapters_tokens_s"], 2
        )
    shutil.rmtree(work, ignore_errors=True)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="the base GGUF (default: a random one of --shape)")
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--quantize", default="Q8_0", help="the random base's type (make_model.py --quantize)")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/minibatch/bench-models"))
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2, help="requests a client, one after another")
    ap.add_argument("--tokens", type=int, default=64, help="tokens a request generates")
    ap.add_argument("--greedy", action="store_true", help="greedy requests (default: sampled)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", default=None, help="llama-server binary (else $LLAMA_SERVER or PATH)")
    ap.add_argument("--port", type=int, default=18961)
    ap.add_argument("--json", type=Path, default=Path("results/bench_lora.json"))
    args = ap.parse_args()
    found = args.llama_server or os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    args.exe = llamacpp.find_server(args.llama_server) if found else None
    report = asyncio.run(main_async(args))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print("| server | base tokens/s | adapters tokens/s | adapters / base |\n|---|---:|---:|---:|")
    for name in ("minibatch", "llama.cpp"):
        if name in report:
            r = report[name]
            print(f"| {name} | {r['base_tokens_s']} | {r['adapters_tokens_s']} | {r['adapters_over_base']} |")
    if "minibatch_over_llama_cpp" in report:
        print(f"minibatch / llama.cpp with the adapters: {report['minibatch_over_llama_cpp']}x")


if __name__ == "__main__":
    main()

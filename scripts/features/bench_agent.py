"""An agent's trace with the disk prompt cache off and on, beside llama-server: the time to the first token of
every turn of a conversation whose long prefix (a system prompt, a tool list, the files it read) is the same
at every turn, with the server restarted and the model unloaded between turns.

  .venv/bin/python scripts/features/bench_agent.py --gguf models/qwen05b-q4km.gguf --llama-server /path/to/llama-server
  .venv/bin/python scripts/features/bench_agent.py --system-tokens 1500 --turns 5 --restart-after 2 --unload-after 3

The trace is fixed and the same for every server: a system part of --system-tokens tokens (instructions, a JSON
list of tools, then source files of this project as the files the agent read), then --turns turns; each turn
sends everything so far (the system part, every earlier question with a fixed answer) and a new question, over
/v1/completions, and takes --max-tokens greedy tokens (ignore_eos). The server is stopped and started again
(the same prompt-cache folder) before turn --restart-after + 1, and minibatchd's model is unloaded (Ollama's
keep_alive 0) before turn --unload-after + 1; llama-server has no unload, so that turn keeps its memory there.
Variants: minibatchd with --prompt-cache-gb 0 ("off"), minibatchd with the disk tier in a fresh folder ("on"),
and llama-server (its prompt cache in memory, `cache_prompt`), each alone on the cores.

TTFT is the server's own: minibatchd's `minibatch.ttft_ms` (arrival to the first token: the wait for blocks
from disk included), llama-server's `timings.prompt_ms`; `answer_s` is the client's time for the whole
request (a reload after an unload included). With --cold-prompts N, each minibatchd variant also answers N
distinct prompts of --cold-tokens tokens nothing on disk matches: the tier's cost when it has nothing to give.
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
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import aiohttp  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FILES = ("engine/core/scheduler.py", "engine/core/block_manager.py", "engine/core/engine.py", "daemon/app.py")
ANSWER = "I looked at the scheduler and the block manager. The change belongs in `_admit`; I will edit it next."


def system_part(tokenizer, n_tokens: int) -> str:
    """Instructions, a tool list and source files, cut at `n_tokens` tokens."""
    tools = [
        {
            "name": f"tool_{i}",
            "description": f"Tool number {i}: reads, searches or edits the repository's files ({i % 7} modes).",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "line": {"type": "integer"}}},
        }
        for i in range(40)
    ]
    text = (
        "You are a coding agent working in a Python repository. Use the tools to read and edit files.\n"
        f"Tools:\n{json.dumps(tools, indent=1)}\n\nFiles you have read:\n"
    )
    for path in FILES:
        text += f"\n### {path}\n{(ROOT / path).read_text()}"
    ids = tokenizer.encode(text)
    if len(ids) < n_tokens:
        ids = (ids * (n_tokens // len(ids) + 1))[:n_tokens]
    return tokenizer.decode(ids[:n_tokens])


def turn_prompt(system: str, turn: int) -> str:
    text = system
    for t in range(1, turn):
        text += f"\nUser: Step {t}: what should change in the scheduler now?\nAssistant: {ANSWER}"
    return text + f"\nUser: Step {turn}: what should change in the scheduler now?\nAssistant:"


class Minibatchd:
    def __init__(self, args, cache_gb: float, cache_dir: Path, workdir: Path) -> None:
        self.sock = str(workdir / "mb.sock")
        self.argv = [
            str(Path(sys.executable).parent / "minibatchd"),
            "start",
            "--socket", self.sock,
            "--model", str(args.gguf or "smollm2-135m-instruct"),
            "--threads", str(args.threads),
            "--max-num-seqs", "4",
            "--kv-cache-tokens", str(args.ctx),
            "--max-model-len", str(args.ctx),
            "--speculative", "off",
            "--request-timeout", "7200",
            "--prompt-cache-gb", str(cache_gb),
            "--prompt-cache-dir", str(cache_dir),
        ]  # fmt: skip
        self.url = "http://localhost/v1/completions"

    def start(self) -> None:
        subprocess.run(self.argv, check=True, capture_output=True, timeout=900)

    def stop(self) -> None:
        subprocess.run([self.argv[0], "stop", "--socket", self.sock], capture_output=True, timeout=300)

    def session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=self.sock), timeout=aiohttp.ClientTimeout(total=None)
        )

    async def unload(self) -> None:
        async with self.session() as s:
            async with s.get("http://localhost/health") as r:
                name = (await r.json())["model"]
            async with s.post("http://localhost/api/generate", json={"model": name, "keep_alive": 0}) as r:
                if r.status != 200:
                    raise SystemExit(f"unload: {r.status} {await r.text()}")

    async def stats(self) -> dict:
        async with self.session() as s:
            async with s.get("http://localhost/v1/engine/stats?steps=0") as r:
                return await r.json()


class LlamaServer:
    def __init__(self, args) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.argv = [args.llama_server, "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(self.port),
                     "-t", str(args.threads), "-tb", str(args.threads), "-np", "1", "-c", str(args.ctx),
                     "--no-webui"]  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}/v1/completions"
        self.proc = None

    def start(self) -> None:
        log = open(Path(tempfile.gettempdir()) / "llama-agent.log", "ab")
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2).status == 200:
                    return
            except OSError:
                time.sleep(0.5)
        raise SystemExit("llama-server did not become ready")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)

    def session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True), timeout=aiohttp.ClientTimeout(total=None)
        )


async def ask(server, prompt: str, max_tokens: int) -> dict:
    """One streamed request: the server's TTFT, its cached prompt tokens, the client's time for the answer."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.monotonic()
    mine = theirs = usage = None
    async with server.session() as s:
        async with s.post(server.url, json=body) as resp:
            if resp.status != 200:
                raise SystemExit(f"{server.url}: {resp.status} {await resp.text()}")
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("error"):
                    raise SystemExit(f"{server.url}: {chunk['error']}")
                usage = chunk.get("usage") or usage
                mine = chunk.get("minibatch") or mine
                theirs = chunk.get("timings") or theirs
    answer_s = time.monotonic() - start
    if mine:
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {"ttft": mine["ttft_ms"] / 1e3, "prompt_tokens": usage["prompt_tokens"], "cached": cached,
                "answer_s": answer_s}  # fmt: skip
    total = (usage or {}).get("prompt_tokens") or theirs["prompt_n"] + theirs.get("cache_n", 0)
    return {
        "ttft": theirs["prompt_ms"] / 1e3,
        "prompt_tokens": total,
        "cached": total - theirs["prompt_n"],
        "answer_s": answer_s,
    }  # fmt: skip  (llama-server evaluates prompt_n tokens: the rest it reused)


def run_trace(name: str, server, args, prompts: list[str], cold: list[str]) -> dict:
    rows = []
    server.start()
    try:
        for turn, prompt in enumerate(prompts, 1):
            event = ""
            if turn == args.restart_after + 1:
                server.stop()
                server.start()
                event = "restarted"
            if turn == args.unload_after + 1 and isinstance(server, Minibatchd):
                asyncio.run(server.unload())
                event = "unloaded"
            row = asyncio.run(ask(server, prompt, args.max_tokens)) | {"turn": turn, "event": event}
            rows.append(row)
            print(f"  {name} turn {turn:2d}{' (' + event + ')' if event else '':12s} TTFT {row['ttft']:8.2f} s, "
                  f"{row['cached']:5d}/{row['prompt_tokens']} cached", flush=True)  # fmt: skip
        cold_ttft = [asyncio.run(ask(server, p, args.max_tokens))["ttft"] for p in cold]
        extra = asyncio.run(server.stats()) if isinstance(server, Minibatchd) else {}
    finally:
        server.stop()
    disk = {k: v for k, v in extra.items() if k.startswith("disk_")}
    return {"server": name, "turns": rows, "cold_ttft": cold_ttft, "disk": disk}


def crossover(args) -> list[dict]:
    """In-process: the time to the first token of a request whose first k blocks are on disk (read back) and of
    the same request recomputed, alone and beside --busy decoding requests; the median of --repeats each."""
    from minibatch.engine.core.sampling_params import SamplingParams
    from minibatch.engine.factory import EngineConfig, build_engine

    model = str(args.gguf or "smollm2-135m-instruct")
    rng = random.Random(1)
    ks = [int(k) for k in args.crossover.split(",")]
    prompts = {(k, r): [rng.randrange(100, 20000) for _ in range(16 * k + 8)] for k in ks for r in range(args.repeats)}
    busy_prompts = [[rng.randrange(100, 20000) for _ in range(32)] for _ in range(args.busy)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="mb-cross-", dir="/tmp") as d:

        def engine(gb: float):
            cfg = EngineConfig(model=model, threads=args.threads, prompt_cache_gb=gb, prompt_cache_dir=d,
                               prompt_cache_min_tokens=16, speculative="off")  # fmt: skip
            return build_engine(cfg)

        writer = engine(1.0)
        for i, p in enumerate(prompts.values()):
            writer.add_request(f"w{i}", p, SamplingParams(max_tokens=1))
        while writer.has_work():
            writer.step()
        writer.tier.flush()
        writer.close()
        for busy in (0, args.busy):
            for tier_on in (False, True):
                eng = engine(1.0 if tier_on else 0.0)
                for i, p in enumerate(busy_prompts[:busy]):
                    eng.add_request(f"b{i}", p, SamplingParams(max_tokens=4000, ignore_eos=True))
                for _ in range(3):
                    eng.step()  # the busy ones are decoding
                for (k, r), p in prompts.items():
                    req = eng.add_request(f"k{k}-{r}", p, SamplingParams(max_tokens=1))
                    while not req.status.finished:
                        outs, stats = eng.step()
                        if stats is None and not outs:
                            time.sleep(0.001)
                    rows.append({"k": k, "busy": busy, "tier": tier_on, "ttft": req.metrics().ttft,
                                 "disk_tokens": req.num_disk_cached_tokens})  # fmt: skip
                for i in range(busy):
                    eng.abort(f"b{i}")
                eng.step()
                eng.close()
    print("| blocks on disk | busy | recompute TTFT ms | read TTFT ms | read / recompute |\n|---:|---:|---:|---:|---:|")
    for busy in (0, args.busy):
        for k in ks:
            off = statistics.median(x["ttft"] for x in rows if (x["k"], x["busy"], x["tier"]) == (k, busy, False))
            on = statistics.median(x["ttft"] for x in rows if (x["k"], x["busy"], x["tier"]) == (k, busy, True))
            print(f"| {k} | {busy} | {off * 1e3:.1f} | {on * 1e3:.1f} | {on / off:.2f} |")
    return rows


def overhead(args) -> list[dict]:
    """In-process A/B: two engines of the model, the disk tier on and off, answer --overhead pairs of distinct
    prompts of --cold-tokens tokens that nothing on disk matches, alternating which goes first; every block
    the tier-on engine computes is written. The time to the first token of each, and their ratio per pair."""
    from minibatch.engine.core.sampling_params import SamplingParams
    from minibatch.engine.factory import EngineConfig, build_engine

    model = str(args.gguf or "smollm2-135m-instruct")
    rng = random.Random(2)
    rows = []
    with tempfile.TemporaryDirectory(prefix="mb-overhead-", dir="/tmp") as d:
        engines = {}
        for on in (False, True):
            cfg = EngineConfig(model=model, threads=args.threads, prompt_cache_gb=8.0 if on else 0.0,
                               prompt_cache_dir=d, speculative="off", max_model_len=args.cold_tokens + 64)  # fmt: skip
            engines[on] = build_engine(cfg)
        for i in range(args.overhead):
            pair = {}
            for on in (i % 2 == 0, i % 2 == 1):
                prompt = [rng.randrange(100, 20000) for _ in range(args.cold_tokens)]
                req = engines[on].add_request(f"o{i}-{on}", prompt, SamplingParams(max_tokens=1))
                while not req.status.finished:
                    engines[on].step()
                pair[on] = req.metrics().ttft
            if engines[True].tier is not None:
                engines[True].tier.flush()
            rows.append({"off": pair[False], "on": pair[True], "ratio": pair[True] / pair[False]})
            print(f"  pair {i}: off {pair[False]:.2f} s, on {pair[True]:.2f} s: {pair[True] / pair[False]:.3f}")
        written = engines[True].state().disk_written_blocks
        for e in engines.values():
            e.close()
    ratio = statistics.median(r["ratio"] for r in rows)
    print(f"tier on / off, nothing to hit, median of {len(rows)} pairs: {ratio:.3f} ({written} blocks written)")
    return rows


def table(results: list[dict]) -> str:
    names = [r["server"] for r in results]
    lines = ["| turn | " + " | ".join(f"{n} TTFT s (cached)" for n in names) + " |",
             "|---:|" + "---|" * len(names)]  # fmt: skip
    for i, row in enumerate(results[0]["turns"]):
        cells = []
        for r in results:
            t = r["turns"][i]
            cells.append(f"{t['ttft']:.2f} ({t['cached']})")
        event = f" ({row['event']})" if row["event"] else ""
        lines.append(f"| {row['turn']}{event} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=None, help="the model file (default: the built-in model)")
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"), help="also run llama-server")
    ap.add_argument("--system-tokens", type=int, default=8000)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--restart-after", type=int, default=3)
    ap.add_argument("--unload-after", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=0, help="pool and context tokens (default: the last prompt + 512)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--cold-prompts", type=int, default=0, help="distinct prompts nothing on disk matches")
    ap.add_argument("--cold-tokens", type=int, default=1024)
    ap.add_argument("--variants", default="off,on", help="minibatchd's: off, on")
    ap.add_argument("--crossover", default=None, help="K,K,...: only the in-process read-or-recompute crossover")
    ap.add_argument("--busy", type=int, default=4, help="--crossover: requests decoding beside")
    ap.add_argument("--overhead", type=int, default=0, help="N: only the in-process A/B of the tier's cost, N pairs")
    ap.add_argument("--repeats", type=int, default=5, help="--crossover: requests per point")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.crossover or args.overhead:
        rows = crossover(args) if args.crossover else overhead(args)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return 0

    from minibatch.engine.kv_offload.disk import DEFAULT_GB
    from minibatch.engine.store.cache import resolve_model
    from minibatch.engine.text.tokenizer import TextTokenizer

    tok = TextTokenizer(resolve_model(str(args.gguf) if args.gguf else "smollm2-135m-instruct"))
    system = system_part(tok, args.system_tokens)
    prompts = [turn_prompt(system, t) for t in range(1, args.turns + 1)]
    rng = random.Random(0)
    cold = []
    for _ in range(args.cold_prompts):
        words = [f"w{rng.randrange(10**6)}" for _ in range(args.cold_tokens * 2)]
        cold.append(tok.decode(tok.encode(" ".join(words))[: args.cold_tokens]))
    if not args.ctx:
        args.ctx = len(tok.encode(prompts[-1])) + args.max_tokens + 512
    print(
        f"system part {len(tok.encode(system))} tokens, last prompt {len(tok.encode(prompts[-1]))} tokens", flush=True
    )

    results = []
    for variant in filter(None, args.variants.split(",")):
        with tempfile.TemporaryDirectory(prefix="mb-agent-", dir="/tmp") as d:
            gb = {"off": 0.0, "on": DEFAULT_GB}[variant]
            server = Minibatchd(args, gb, Path(d) / "prompt-cache", Path(d))
            results.append(run_trace(f"minibatchd disk tier {variant}", server, args, prompts, cold))
    if args.llama_server and args.gguf:
        results.append(run_trace("llama-server", LlamaServer(args), args, prompts, []))

    print("\n" + table(results))
    by = {r["server"]: r for r in results}
    on, off = by.get("minibatchd disk tier on"), by.get("minibatchd disk tier off")
    if on and off and args.restart_after < args.turns:
        k = args.restart_after
        a, b = on["turns"][k]["ttft"], off["turns"][k]["ttft"]
        print(f"\nfirst turn after the restart: {a:.2f} s with the tier, {b:.2f} s without: {a / b:.1%}")
    if on and off and args.cold_prompts:
        ratio = statistics.median(on["cold_ttft"]) / statistics.median(off["cold_ttft"])
        print(f"nothing to hit ({args.cold_prompts} prompts of {args.cold_tokens} tokens): on / off TTFT {ratio:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                        indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

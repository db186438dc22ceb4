#!/usr/bin/env python3
"""Several models in one daemon: load times, two models busy at once against each alone, memory after unload.

For each model of --models (default: the built-in model and a random model of its exact shape that this
script writes with make_model.py when missing), through the daemon's socket:

  load    the first load (its GGUF prepared into the cache, when the cache is new) and a reload after an
          unload (keep_alive 0), both as Ollama's empty /api/generate; the daemon's RSS before, loaded and
          after the unload (once its memory is returned)
  busy    a closed loop of --concurrency streams per model sending --requests greedy chats each: model A
          alone, model B alone, then both at once; tokens/s per model and in all, TTFT and TPOT p50/p95,
          medians of --repeats alternating runs

Without --socket it starts its own daemon for each --loops rule (shared: every model's steps alternate on
one thread; per-model: a thread each, stepping at once), with a fresh model cache.

    python scripts/features/bench_models.py
    python scripts/features/bench_models.py --models smollm2-135m-instruct,/models/qwen05b.gguf --loops shared,per-model
    python scripts/features/bench_models.py --socket /tmp/d.sock --models smollm2-135m-instruct,qwen2.5:0.5b

With --socket, --models are names that daemon serves (GET /v1/models); a daemon this script starts serves a
model given by path from a models folder of its own, under the file's name.
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
from benchlib import CHAT_SET, summarize  # noqa: E402
from loadgen import session, stream_request  # noqa: E402

from minibatch.daemon.client import request_json  # noqa: E402

SCRIPTS = Path(__file__).resolve().parents[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def prompts(n: int) -> list[str]:
    items = [json.loads(line) for line in CHAT_SET.read_text().splitlines() if line.strip()]
    texts = [i["messages"][-1]["content"] if "messages" in i else i["prompt"] for i in items]
    return [texts[k % len(texts)] for k in range(n)]


class Target:
    """The daemon: given (--socket), or one this script starts with `loop` and a fresh model cache."""

    def __init__(self, args, loop: str | None, models: list[str]) -> None:
        """`models`: what requests name; for a daemon this script starts, a model given by path is served
        from a models folder of its own under its file's (or folder's) name, since a request names models,
        never files."""
        self.folder = None
        self.names = list(models)
        if args.socket:
            self.socket = args.socket
            return
        self.folder = Path(tempfile.mkdtemp(prefix="mb-models-", dir="/tmp"))
        self.socket = str(self.folder / "d.sock")
        cache, folder = self.folder / "cache", self.folder / "models"
        folder.mkdir()
        for i, spec in enumerate(models):
            path = Path(spec).expanduser()
            if path.exists():
                (folder / path.name).symlink_to(path.resolve())
                self.names[i] = path.stem if path.suffix == ".gguf" else path.name
        cmd = [sys.executable, "-m", "minibatch.daemon.cli", "start", "--socket", self.socket]
        cmd += ["--model", self.names[0], "--engine-loop", loop, "--log-file", str(self.folder / "d.log")]
        cmd += ["--kv-cache-gb", str(args.kv_cache_gb), *args.daemon_arg]
        env = {**os.environ, "MINIBATCH_CACHE_DIR": str(cache), "MINIBATCH_MODELS_DIR": str(folder)}
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)

    def get(self, path: str) -> dict:
        status, body = request_json(self.socket, "GET", path, timeout=60)
        if status != 200:
            raise RuntimeError(f"{path}: HTTP {status}: {body}")
        return body

    def post(self, path: str, body: dict, timeout: float = 900) -> dict:
        status, out = request_json(self.socket, "POST", path, body, timeout=timeout)
        if status != 200:
            raise RuntimeError(f"{path} {body}: HTTP {status}: {out}")
        return out

    def loaded(self) -> dict[str, dict]:
        return {m["name"]: m for m in self.get("/health")["models"]}

    def stop(self) -> None:
        if self.folder is not None:
            subprocess.run(
                [sys.executable, "-m", "minibatch.daemon.cli", "stop", "--socket", self.socket],
                check=False,
                stdout=subprocess.DEVNULL,
            )
            shutil.rmtree(self.folder, ignore_errors=True)


def wait_returned(t: Target, pid: int, loaded_mb: float, timeout: float = 5.0) -> float:
    """RSS once the unloaded model's memory is back (the daemon frees it within a second)."""
    deadline, last = time.monotonic() + timeout, rss_mb(pid)
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = rss_mb(pid)
        if now < loaded_mb - 1 and abs(now - last) < 1:
            return now
        last = now
    return rss_mb(pid)


def measure_loads(t: Target, models: list[str]) -> list[dict]:
    pid = t.get("/health")["pid"]
    was_loaded = set(t.loaded())
    rows = []
    for name in models:
        if name in t.loaded():
            t.post("/api/generate", {"model": name, "keep_alive": 0})
            wait_returned(t, pid, rss_mb(pid))
        entry: dict = {"model": name}
        for kind in ("first", "reload"):
            before = rss_mb(pid)
            started = time.monotonic()
            t.post("/api/generate", {"model": name, "stream": False, "keep_alive": -1})
            wall = time.monotonic() - started
            facts = t.loaded()[name]
            loaded = rss_mb(pid)
            t.post("/api/generate", {"model": name, "keep_alive": 0})
            after = wait_returned(t, pid, loaded)
            entry[kind] = {
                "wall_s": wall,
                "load_s": facts["load_seconds"],
                "rss_before_mb": before,
                "rss_loaded_mb": loaded,
                "rss_after_unload_mb": after,
                "footprint_mb": facts["memory_bytes"] / 2**20,
            }
        rows.append(entry)
        f, r = entry["first"], entry["reload"]
        print(
            f"load {name}: first {f['wall_s']:.2f} s (engine {f['load_s']:.2f} s), reload {r['wall_s']:.2f} s; "
            f"RSS {r['rss_before_mb']:.0f} -> {r['rss_loaded_mb']:.0f} -> {r['rss_after_unload_mb']:.0f} MB "
            f"(weights + KV {r['footprint_mb']:.0f} MB)",
            flush=True,
        )
    for name in was_loaded & set(models):  # as it found them
        t.post("/api/generate", {"model": name, "stream": False, "keep_alive": -1})
    return rows


async def closed_loop(s, model: str, texts: list[str], c: int, max_tokens: int):
    queue = list(enumerate(texts))
    results = []

    async def worker():
        while queue:
            i, text = queue.pop(0)
            body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
            results.append(await stream_request(s, i, {**body, "temperature": 0, "ignore_eos": True}))

    start = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(c)))
    return results, time.monotonic() - start


async def busy(t: Target, args, models: list[str]) -> list[dict]:
    texts = prompts(args.requests)
    for name in models:  # loaded and warm
        t.post("/api/generate", {"model": name, "stream": False, "keep_alive": -1})
    scenarios = [("alone", [models[0]]), ("alone", [models[1]]), ("together", models)]
    runs: dict[tuple, list[dict]] = {}
    async with session(t.socket) as s:
        await closed_loop(s, models[0], texts[:2], 2, 8)
        await closed_loop(s, models[1], texts[:2], 2, 8)
        for rep in range(args.repeats):
            for kind, names in scenarios if rep % 2 == 0 else scenarios[::-1]:
                outs = await asyncio.gather(
                    *(closed_loop(s, n, texts, args.concurrency, args.max_tokens) for n in names)
                )
                wall = max(w for _, w in outs)
                for n, (results, w) in zip(names, outs):
                    runs.setdefault((kind, n), []).append(summarize(results, w))
                if len(names) > 1:  # the two together: every token over the wall time of both
                    runs.setdefault((kind, "+".join(names)), []).append(
                        {"output_throughput": sum(summarize(r, wall)["output_throughput"] for r, _ in outs)}
                    )
    rows = []
    for (kind, name), rs in runs.items():
        row = {"scenario": kind, "model": name, "tokens_per_s": statistics.median(r["output_throughput"] for r in rs)}
        if "ttft" in rs[0]:
            for metric in ("ttft", "tpot"):
                for q in ("p50", "p95"):
                    row[f"{metric}_{q}_ms"] = 1e3 * statistics.median(r[metric][q] or 0 for r in rs)
            row["failed"] = sum(r["failed"] for r in rs)
        rows.append(row)
    return rows


def table(rows: list[dict], loop: str) -> str:
    out = [
        f"engine loop: {loop}",
        "| scenario | model | tokens/s | TTFT p50 | TTFT p95 | TPOT p50 | TPOT p95 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lat = (
            " | ".join(f"{r[k]:.0f} ms" for k in ("ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms", "tpot_p95_ms"))
            if "ttft_p50_ms" in r
            else "| | |"
        )
        out.append(f"| {r['scenario']} | {r['model']} | {r['tokens_per_s']:.1f} | {lat} |")
    return "\n".join(out)


def second_model(args) -> str:
    """A random model of the built-in's exact shape (or --make-layers layers of it), made once."""
    path = Path(args.make_dir) / f"smollm2-shape-{args.make_layers or 'full'}.q4_1.gguf"
    if not path.exists():
        cmd = [sys.executable, str(SCRIPTS / "dev" / "make_model.py"), "--shape", "smollm2-135m", "--out", str(path)]
        cmd += ["--quantize", "Q4_1"] + (["--layers", str(args.make_layers)] if args.make_layers else [])
        subprocess.run(cmd, check=True)
    return str(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--socket", default=None, help="a running daemon (default: start one per --loops rule)")
    ap.add_argument("--models", default=None, help="two models, comma-separated (default: see above)")
    ap.add_argument("--loops", default="shared,per-model", help="engine-loop rules to compare (own daemons only)")
    ap.add_argument("--concurrency", type=int, default=4, help="streams per model")
    ap.add_argument("--requests", type=int, default=16, help="requests per model per run")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-cache-gb", type=float, default=0.25)
    ap.add_argument("--make-dir", default=str(Path(tempfile.gettempdir()) / "minibatch-bench-models"))
    ap.add_argument("--make-layers", type=int, default=None, help="the made model's layers (default: all 30)")
    ap.add_argument("--skip-loads", action="store_true", help="only the busy comparison")
    ap.add_argument("--skip-busy", action="store_true", help="only the loads and memory")
    ap.add_argument("--daemon-arg", action="append", default=[], help="passed to minibatchd start")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.models is None:
        args.models = f"smollm2-135m-instruct,{second_model(args)}"
    models = args.models.split(",")
    if len(models) != 2:
        ap.error("--models takes two models")
    report: dict = {"models": models, "loops": {}}
    for loop in [None] if args.socket else args.loops.split(","):
        t = Target(args, loop, models)
        try:
            name = loop or "the daemon's"
            entry: dict = {}
            if not args.skip_loads:
                entry["loads"] = measure_loads(t, t.names)
            if not args.skip_busy:
                entry["busy"] = asyncio.run(busy(t, args, t.names))
                print(table(entry["busy"], name), flush=True)
            report["loops"][name] = entry
        finally:
            t.stop()
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Speculative decoding on and off, side by side through the socket: tokens/s, TPOT, acceptance.

One daemon started with --speculative ngram serves both variants: a request with `"speculative": false`
runs exactly as with speculation off (no drafts, one token per step), so the variants alternate in one
run on one engine. For each workload and each concurrency c, a closed loop of c streams sends
`--requests-per-c x c` requests (at least 8, at most 64), greedy, each variant `--repeats` times,
alternating; the tables show medians. `--in-process verify-cost` times one forward by decoding rows and
draft length (the cost the draft-length rule weighs); `--in-process draft-sweep` runs one request at a
time in-process with speculation off and at several draft lengths and n-gram sizes.

Workloads:
  chat   the bundled chat set (scripts/data/chat_prompts.jsonl)
  copy   copy-heavy prompts (scripts/data/copy_prompts.jsonl): edit, fix, extract, continue a list
  forced random windows of Hamlet sent as completions with ignore_eos and a forced length: the model
         rambles past its text, so drafts are mostly wrong (what the adaptive rule must not lose on)

    python scripts/features/bench_spec.py                      # starts its own daemon on the built-in model
    python scripts/features/bench_spec.py --socket /tmp/d.sock # a daemon you started with --speculative ngram
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_chat import Daemon  # noqa: E402
from benchlib import CHAT_SET, summarize  # noqa: E402
from loadgen import session, stream_request  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data"
COPY_SET = DATA / "copy_prompts.jsonl"
HAMLET = DATA / "hamlet.txt"
VARIANTS = {"off": False, "ngram": True}


def workload(name: str, n: int, seed: int, max_tokens: int) -> list[tuple[dict, bool]]:
    """(body, is a chat request) for n requests of the named workload."""
    rng = random.Random(seed)
    if name in ("chat", "copy"):
        rows = [json.loads(line) for line in (CHAT_SET if name == "chat" else COPY_SET).read_text().splitlines()]
        picks = [rows[(i + seed) % len(rows)] for i in range(n)]
        return [
            (
                {
                    "messages": [{"role": "user", "content": r["prompt"]}],
                    "max_tokens": min(r["max_tokens"], max_tokens),
                    "temperature": 0,
                },
                True,
            )
            for r in picks
        ]
    words = HAMLET.read_text().split()
    out = []
    for _ in range(n):
        start = rng.randrange(0, len(words) - 80)
        body = {"prompt": " ".join(words[start : start + 60]), "max_tokens": max_tokens}
        out.append(({**body, "temperature": 0, "ignore_eos": True}, False))
    return out


async def closed_loop(s, bodies: list[tuple[dict, bool]], c: int, speculative: bool) -> dict:
    queue = list(enumerate(bodies))
    results = []

    async def worker():
        while queue:
            i, (body, chat) = queue.pop(0)
            results.append(await stream_request(s, i, {**body, "speculative": speculative}, chat))

    start = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(c)))
    wall = time.monotonic() - start
    summary = summarize(results, wall)
    drafted = sum((r.server or {}).get("draft_tokens", 0) for r in results)
    accepted = sum((r.server or {}).get("accepted_tokens", 0) for r in results)
    summary["draft_tokens"], summary["accepted_tokens"] = drafted, accepted
    summary["texts"] = [r.text for r in sorted(results, key=lambda r: r.index)]
    return summary


async def measure(args, target) -> list[dict]:
    rows = []
    async with session(target if not target.startswith("http") else None, args.url, args.api_key) as s:
        for name in args.workloads.split(","):
            for c in [int(x) for x in args.concurrency.split(",")]:
                n = min(64, max(8, args.requests_per_c * c)) if c <= 64 else c
                bodies = workload(name, n, args.seed, args.max_tokens)
                await closed_loop(s, bodies[: min(c, 4)], min(c, 4), True)  # warm-up: caches, the cost fit
                # Every prompt once, so both variants find it in the prefix cache: on native weights a prompt
                # computed in other chunks can differ in its last bits and a greedy answer at a near-tie with it
                # (BENCHMARKS.md, "Speculative decoding"), which would be the cache's doing, not speculation's.
                await closed_loop(s, [({**b, "max_tokens": 1}, chat) for b, chat in bodies], c, False)
                runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
                for rep in range(args.repeats):
                    order = list(VARIANTS) if rep % 2 == 0 else list(VARIANTS)[::-1]
                    for variant in order:
                        runs[variant].append(await closed_loop(s, bodies, c, VARIANTS[variant]))
                        if args.verbose:
                            print(f"    {name} c={c} {variant}: {runs[variant][-1]['output_throughput']:.1f} tok/s")
                pairs = list(zip(runs["off"][0]["texts"], runs["ngram"][0]["texts"]))
                differ = [i for i, (a, b) in enumerate(pairs) if a != b]
                same = not differ
                for variant, rs in runs.items():
                    row = {
                        "workload": name,
                        "concurrency": c,
                        "variant": variant,
                        "requests": n,
                        "tokens_per_s": statistics.median(r["output_throughput"] for r in rs),
                        "tpot_p50_ms": 1e3 * statistics.median(r["tpot"]["p50"] or 0 for r in rs),
                        "tpot_p95_ms": 1e3 * statistics.median(r["tpot"]["p95"] or 0 for r in rs),
                        "draft_tokens": statistics.median(r["draft_tokens"] for r in rs),
                        "accepted_tokens": statistics.median(r["accepted_tokens"] for r in rs),
                        "failed": sum(r["failed"] for r in rs),
                        "same_text_as_off": same,
                        "texts_differing": len(differ),
                    }
                    if differ and variant == "ngram":  # the first pair that parts, to look at
                        row["first_difference"] = list(pairs[differ[0]])
                    d = row["draft_tokens"]
                    row["acceptance"] = row["accepted_tokens"] / d if d else None
                    rows.append(row)
                off, on = rows[-2], rows[-1]
                on["speedup"] = on["tokens_per_s"] / off["tokens_per_s"] if off["tokens_per_s"] else None
                print(
                    f"{name:>6} c={c:<3} off {off['tokens_per_s']:7.1f} tok/s  ngram {on['tokens_per_s']:7.1f} "
                    f"({on['speedup']:.2f}x)  accepted {on['accepted_tokens']:.0f}/{on['draft_tokens']:.0f}  "
                    f"texts differing: {len(differ)}/{len(pairs)}",
                    flush=True,
                )
    return rows


def verify_cost(args) -> list[dict]:
    """In-process: one forward of `rows` decoding rows, each verifying k (fake) draft tokens, median ms."""
    from minibatch.engine.core.sampling_params import SamplingParams
    from minibatch.engine.core.scheduler_output import SchedulerOutput
    from minibatch.engine.factory import EngineConfig, build_engine

    engine = build_engine(EngineConfig(model=args.model, speculative="off", max_wait_ms=0, max_num_seqs=64))
    tok = engine.tokenizer
    reqs = [
        engine.add_request(
            f"r{b}",
            tok.chat([{"role": "user", "content": f"Tell me about the number {b}."}]),
            SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True),
        )
        for b in range(16)
    ]
    for _ in range(3):
        engine.step()
    out_rows = []
    for rows in (1, 4, 16):
        row = {"rows": rows}
        for k in (0, 1, 2, 4, 8):
            times = []
            for _ in range(args.repeats * 5):
                out = SchedulerOutput()
                for r in reqs[:rows]:
                    engine.scheduler.blocks.allocate(r, 1 + k)
                    out.add(r, 1, [5] * k)  # never accepted: the cost of the rows alone
                t0 = time.perf_counter()
                engine.runner.execute(out)
                times.append(time.perf_counter() - t0)
            row[f"k{k}_ms"] = 1e3 * statistics.median(times)
        print(f"{rows:>3} rows: " + "  ".join(f"k={k}: {row[f'k{k}_ms']:6.1f} ms" for k in (0, 1, 2, 4, 8)), flush=True)
        out_rows.append(row)
    return out_rows


def draft_sweep(args) -> list[dict]:
    """In-process, one request at a time: tok/s with speculation off and at several K and n-gram sizes."""
    from minibatch.engine.core.sampling_params import SamplingParams
    from minibatch.engine.factory import EngineConfig, build_engine
    from minibatch.engine.spec_decode.config import SpecConfig
    from minibatch.engine.spec_decode.decoder import SpecDecoder

    engine = build_engine(EngineConfig(model=args.model, speculative="off", max_wait_ms=0))
    configs = {"off": None}
    for k in (2, 4, 8):
        for n_min in (1, 2):
            configs[f"K={k} n={n_min}..4"] = SpecConfig("ngram", k, n_min, 4)
    out = []
    for name in args.workloads.split(","):
        if name == "forced":
            continue
        rows = [json.loads(line) for line in (CHAT_SET if name == "chat" else COPY_SET).read_text().splitlines()]
        prompts = [(engine.tokenizer.chat([{"role": "user", "content": r["prompt"]}]), r["max_tokens"]) for r in rows]
        prompts = [(p, min(m, args.max_tokens)) for p, m in prompts[:8]]
        rates: dict[str, list[float]] = {c: [] for c in configs}
        for rep in range(args.repeats):
            for label, cfg in configs.items():
                engine.spec = SpecDecoder(cfg) if cfg else None
                tokens, t0 = 0, time.perf_counter()
                for i, (p, m) in enumerate(prompts):
                    req = engine.add_request(f"{label}-{rep}-{i}", p, SamplingParams(temperature=0, max_tokens=m))
                    while engine.has_work():
                        engine.step()
                    tokens += len(req.output_token_ids)
                rates[label].append(tokens / (time.perf_counter() - t0))
        base = statistics.median(rates["off"])
        for label, r in rates.items():
            out.append(
                {"workload": name, "config": label, "tok_s": statistics.median(r), "x_off": statistics.median(r) / base}
            )
            print(
                f"{name:>5} {label:<12} {statistics.median(r):6.1f} tok/s  {statistics.median(r) / base:.2f}x",
                flush=True,
            )
    return out


def table(rows: list[dict]) -> str:
    out = [
        "| workload | c | variant | tok/s | × off | TPOT p50 ms | TPOT p95 ms | accepted / drafted | acceptance |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        acc = f"{100 * r['acceptance']:.0f}%" if r["acceptance"] is not None else "-"
        speed = f"{r['speedup']:.2f}" if r.get("speedup") else "1.00" if r["variant"] == "off" else "-"
        out.append(
            f"| {r['workload']} | {r['concurrency']} | {r['variant']} | {r['tokens_per_s']:.1f} | {speed} | "
            f"{r['tpot_p50_ms']:.1f} | {r['tpot_p95_ms']:.1f} | {r['accepted_tokens']:.0f} / {r['draft_tokens']:.0f} "
            f"| {acc} |"
        )
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--socket", default=None, help="a running daemon (started with --speculative ngram)")
    ap.add_argument("--url", default=None, help="a daemon over TCP")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="the model of the daemon this script starts")
    ap.add_argument("--daemon-arg", action="append", default=[], help="extra minibatchd start options")
    ap.add_argument("--workloads", default="chat,copy,forced")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--requests-per-c", type=int, default=2, help="requests per stream (at least 8, at most 64 in all)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--verbose", action="store_true", help="print every run, not only the medians")
    ap.add_argument(
        "--in-process",
        choices=["verify-cost", "draft-sweep"],
        default=None,
        help="instead of the socket: a forward's time by rows and draft length, or tok/s by K and n-gram size",
    )
    args = ap.parse_args()
    if args.in_process:
        rows = verify_cost(args) if args.in_process == "verify-cost" else draft_sweep(args)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return 0
    if not (args.socket or args.url):
        args.daemon_arg = ["--speculative", "ngram", "--max-num-seqs", "64", *args.daemon_arg]
    daemon = Daemon(args)
    try:
        daemon.get("/health")
        if daemon.get("/v1/engine/stats?steps=0").get("speculative") == "off":
            print("the daemon runs with --speculative off: both variants would be the same", file=sys.stderr)
            return 2
        rows = asyncio.run(measure(args, daemon.target))
    finally:
        daemon.stop()
    print()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if not any(r["failed"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

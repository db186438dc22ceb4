"""Benchmark minibatchd over its socket: static vs continuous on the same recorded trace.

  .venv/bin/python scripts/bench.py                         # 64 synthetic requests at once, both modes, 3 repeats
  .venv/bin/python scripts/bench.py --workload chat --arrivals poisson:2
  .venv/bin/python scripts/bench.py --sweep concurrency:1,4,16,32,64 --hf-baseline
  .venv/bin/python scripts/bench.py --sweep rate:0.5,1,2,4 --requests 48
  .venv/bin/python scripts/bench.py --sweep variance --requests 48
  .venv/bin/python scripts/bench.py --url http://127.0.0.1:8080 --model smollm2-135m-instruct   # any OpenAI server
  .venv/bin/python scripts/bench.py --workload chat --api messages   # the same trace through Anthropic's /v1/messages
  .venv/bin/python scripts/bench.py --peers minibatch:native,llama.cpp:Q4_1,llama.cpp:Q8_0 --llama-server PATH

Every variant replays the same trace (prompts, output lengths forced with
ignore_eos, arrival times); each point is the median of --repeats runs after
--warmup requests that are not counted. The daemon's mode is switched between
runs. Each request's text is compared across the modes ("same text": a request
answers alike whatever its batch, so the modes differ in time alone); sampled
requests carry a seed each so that theirs compare too. --natural lets every
answer end where the model ends it (max_tokens a cap): the texts then decide the
lengths. Writes JSON per run, summary.json, table.md and PNG plots to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    CHAT_SET,
    TraceItem,
    chat_trace,
    median_summary,
    sampling_presets,
    summarize,
    synthetic_trace,
)
from loadgen import Result, env_socket, session, steps_since, stream_message, stream_request, wait_mode  # noqa: E402

APIS = ("openai", "messages")  # --api: OpenAI's completions / chat completions, or Anthropic's Messages


def message_body(item: TraceItem, tokenizer) -> dict:
    """The trace item as a Messages request: its conversation, or its prompt's text as one user turn."""
    messages = item.messages
    if messages is None:
        text = item.prompt_text if item.prompt_text is not None else tokenizer.decode(item.prompt_ids)
        messages = [{"role": "user", "content": text}]
    system = [m["content"] for m in messages if m["role"] == "system"]
    body = {"model": "default", "messages": [m for m in messages if m["role"] != "system"]}
    if system:
        body["system"] = "\n".join(system)
    return body | {"max_tokens": item.max_tokens, **SAMPLING, **LENGTHS}


# What every request asks for besides its length: --sampling's preset (greedy unless told).
SAMPLING: dict = {"temperature": 0.0}
# The trace's lengths forced (ignore_eos), or with --natural only capped: each answer ends where the model ends it.
LENGTHS: dict = {"ignore_eos": True}


def body_of(item: TraceItem, index: int) -> tuple[dict, bool]:
    common = {"max_tokens": item.max_tokens, **SAMPLING, **LENGTHS}
    if SAMPLING.get("temperature", 1.0) > 0:  # a seed per request: its text is the same in every mode and run
        common["seed"] = 1000 + index
    if item.messages is not None:
        return {"messages": item.messages, **common}, True
    if item.prompt_text is not None:
        return {"prompt": item.prompt_text, **common}, False
    return {"prompt": item.prompt_ids, **common}, False


async def replay(
    s, trace: list[TraceItem], concurrency: int | None, progress=None, native: bool = True, tokenizer=None
) -> tuple[list[Result], float, dict]:
    """Send the trace on its schedule (at most `concurrency` in flight); sample minibatchd's engine meanwhile.
    With a `tokenizer`, every request goes to Anthropic's /v1/messages instead (the tokenizer decodes
    token-id prompts)."""
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    samples: list[dict] = []
    done = asyncio.Event()

    async def sample():
        while native and not done.is_set():
            async with s.get("/v1/engine/stats?steps=0") as r:
                samples.append(await r.json())
            await asyncio.sleep(0.25)

    async def one(i: int, item: TraceItem) -> Result:
        await asyncio.sleep(max(0.0, start + item.at - time.monotonic()))
        if tokenizer is not None:
            send = stream_message(s, i, message_body(item, tokenizer))
        else:
            body, chat = body_of(item, i)
            send = stream_request(s, i, body, chat)
        if sem is None:
            res = await send
        else:
            async with sem:
                res = await send
        if progress is not None:
            progress.update(1)
        return res

    if not native:
        start = time.monotonic()
        results = await asyncio.gather(*(one(i, it) for i, it in enumerate(trace)))
        return list(results), time.monotonic() - start, {}
    async with s.get("/v1/engine/stats?steps=0") as r:
        before = await r.json()
    start = time.monotonic()
    sampler = asyncio.create_task(sample())
    results = await asyncio.gather(*(one(i, it) for i, it in enumerate(trace)))
    wall = time.monotonic() - start
    done.set()
    await sampler
    async with s.get("/v1/engine/stats?steps=0") as r:
        after = await r.json()
    engine = {
        "mean_running": statistics.fmean(x["running"] for x in samples) if samples else 0.0,
        "kv_usage_peak_percent": max((x["kv_usage_percent"] for x in samples), default=0.0),
        "preemptions": after["preemptions"] - before["preemptions"],
        "wasted_row_steps": after["wasted_row_steps"] - before["wasted_row_steps"],
    }
    return results, wall, engine


def hf_static(model_dir: str, trace: list[TraceItem], batch: int, tokenizer) -> dict:
    """HF transformers generate in left-padded batches of `batch`, in arrival order, all queued at t=0."""
    import torch

    from minibatch.engine.weights.reference import load_hf_reference

    hf = load_hf_reference(model_dir)
    hf.generation_config.eos_token_id = None
    prompts = [
        it.prompt_ids
        if it.prompt_ids is not None
        else list(tokenizer.apply_chat_template(it.messages, add_generation_prompt=True, tokenize=True)["input_ids"])
        for it in trace
    ]
    t0 = time.monotonic()
    results = []
    for s in range(0, len(trace), batch):
        group = list(range(s, min(len(trace), s + batch)))
        width = max(len(prompts[i]) for i in group)
        ids = torch.tensor([[0] * (width - len(prompts[i])) + prompts[i] for i in group])
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(prompts[i]) for i in group])[:, None]).long()
        with torch.no_grad():
            hf.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max(trace[i].max_tokens for i in group),
                pad_token_id=0,
            )
        end = time.monotonic() - t0
        for i in group:  # a padded batch returns everything at its end
            r = Result(i, t0, ok=True, e2e=end, output_tokens=trace[i].max_tokens, finish_reason="length")
            results.append(r)
    return summarize(results, time.monotonic() - t0)


def machine_ceilings(memory: dict | None) -> dict:
    """Measured memory bandwidth and matmul speed, and the decode limits they imply for the served model.

    `memory` is the daemon's own account of its weights (`/health`'s `memory`): the bytes one decode step
    streams through the matmuls, as they are stored (4-bit blocks, packed fp32...), and their parameters.
    Without it (a server that does not say) only the machine's figures are reported."""
    import torch

    a = torch.empty(128 * 2**20 // 4)
    a.fill_(1.0)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    bandwidth = 2 * a.numel() * 4 / best  # read + write
    # what a decode step does to its weights: only read them (a sum over 512 MB, every thread)
    r = torch.ones(512 * 2**20 // 4)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        r.sum()
        best = min(best, time.perf_counter() - t)
    read = r.numel() * 4 / best
    del a, b, r
    x = torch.randn(1024, 1024)
    y = torch.randn(1024, 1024)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x @ y
        best = min(best, time.perf_counter() - t)
    flops = 2 * 1024**3 / best
    out = {"memory_bandwidth_gb_s": bandwidth / 1e9, "memory_read_gb_s": read / 1e9, "matmul_gflop_s": flops / 1e9}
    if memory:
        out |= {
            "model_params": memory["num_params"],
            "weight_bytes": memory["loaded_bytes"],
            "matmul_bytes_per_step": memory["matmul_bytes_per_step"],
            "batch1_bandwidth_bound_tok_s": read / memory["matmul_bytes_per_step"],
            "compute_bound_tok_s": flops / (2 * memory["matmul_params"]),
        }
    return out


def ceilings_line(c: dict) -> str:
    line = (
        f"machine: memory copy {c['memory_bandwidth_gb_s']:.1f} GB/s (read + write), read "
        f"{c['memory_read_gb_s']:.1f} GB/s, fp32 matmul {c['matmul_gflop_s']:.0f} GFLOP/s"
    )
    if "batch1_bandwidth_bound_tok_s" not in c:
        return line + " (the server does not publish its weights: no model bounds)"
    return (
        line + f"; model {c['model_params'] / 1e6:.0f}M parameters, {c['matmul_bytes_per_step'] / 1e6:.0f} MB read "
        f"per decode step -> batch-1 read-bandwidth bound {c['batch1_bandwidth_bound_tok_s']:.1f} tok/s, "
        f"fp32 compute bound {c['compute_bound_tok_s']:.0f} tok/s"
    )


def table(rows: list[dict]) -> str:
    head = (
        "| point | variant | out tok/s | req/s | TTFT p50 / p95 (s) | TPOT p50 (ms) | e2e p50 / p95 (s) "
        "| mean running | wasted rows | preempt | failed | same text |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        s, e = r["summary"], r.get("engine", {})
        f = lambda v, k=1: "-" if v is None else f"{v:.{k}f}"  # noqa: E731
        lines.append(
            f"| {r['point']} | {r['variant']} | {f(s['output_throughput'])} | {f(s['request_throughput'], 2)} | "
            f"{f(s['ttft']['p50'], 2)} / {f(s['ttft']['p95'], 2)} | "
            f"{f(s['tpot']['p50'] and 1000 * s['tpot']['p50'])} | "
            f"{f(s['e2e']['p50'])} / {f(s['e2e']['p95'])} | {f(e.get('mean_running'))} | "
            f"{e.get('wasted_row_steps', '-')} | "
            f"{e.get('preemptions', '-')} | {s['failed']} | {'/'.join(map(str, r.get('same_texts', ['-'])))} |"
        )
    return "\n".join(lines)


def plots(rows: list[dict], ttft: dict[str, list[float]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    colors = {"continuous": "tab:blue", "static": "tab:orange", "hf-static": "tab:gray"}
    for kind, xlabel, ylabel, key, fname in (
        ("concurrency", "concurrent requests", "output tokens/s", "output_throughput", "throughput_vs_concurrency.png"),
        (
            "rate",
            "request rate (req/s)",
            "normalized latency (s / output token)",
            "normalized_latency",
            "latency_vs_rate.png",
        ),
        (
            "variance",
            "output-length standard deviation (tokens)",
            "output tokens/s",
            "output_throughput",
            "throughput_vs_variance.png",
        ),
    ):
        pts = [r for r in rows if r["kind"] == kind]
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4))
        for variant in sorted({r["variant"] for r in pts}):
            vs = sorted((r for r in pts if r["variant"] == variant), key=lambda r: r["x"])
            xs = [r["x"] for r in vs]
            if key == "normalized_latency":
                ax.plot(
                    xs, [r["summary"][key]["p50"] for r in vs], "o-", color=colors.get(variant), label=f"{variant} p50"
                )
                ax.plot(
                    xs, [r["summary"][key]["p95"] for r in vs], "o--", color=colors.get(variant), label=f"{variant} p95"
                )
            else:
                ax.plot(xs, [r["summary"][key] for r in vs], "o-", color=colors.get(variant), label=variant)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        made.append(out / fname)
    if ttft:
        fig, ax = plt.subplots(figsize=(6.4, 4))
        for variant, vals in ttft.items():
            vals = sorted(vals)
            ax.plot(vals, [(i + 1) / len(vals) for i in range(len(vals))], color=colors.get(variant), label=variant)
        ax.set_xlabel("time to first token (s)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "ttft_cdf.png", dpi=110)
        plt.close(fig)
        made.append(out / "ttft_cdf.png")
    return made


def points(args) -> list[tuple[str, float, dict]]:
    """(kind, x, overrides) for every sweep point."""
    if not args.sweep:
        return [("main", 0, {})]
    kind, _, values = args.sweep.partition(":")
    if kind == "concurrency":
        return [("concurrency", int(v), {"concurrency": int(v), "arrivals": "all"}) for v in values.split(",")]
    if kind == "rate":
        return [("rate", float(v), {"arrivals": f"poisson:{v}", "concurrency": None}) for v in values.split(",")]
    if kind == "variance":
        mean = sum(args.output_len) // 2
        spreads = [0, mean // 4, mean // 2, 3 * mean // 4, mean - 8]
        return [("variance", 0, {"output_len": (mean - d, mean + d), "arrivals": "all"}) for d in spreads]
    raise SystemExit(f"unknown sweep {args.sweep!r}: concurrency:…, rate:… or variance")


async def run(args) -> int:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from minibatch.engine.store.cache import ModelNotFoundError, resolve_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.peers:
        return await run_peers(args, out)
    native = args.url is None
    target = ({"socket": args.socket} if native else {"url": args.url}) | {"api_key": args.api_key}
    async with session(**target) as s:
        async with s.get("/health") as r:
            health = await r.json(content_type=None)
            if r.status != 200:
                raise SystemExit(f"bench: server not ready: {health}")
    if not native and args.model is None:
        raise SystemExit("bench: --url needs --model (whose tokenizer makes the prompts)")
    try:
        model_dir = resolve_model(health["model"] if args.model is None else args.model)
    except ModelNotFoundError:  # a daemon shows a model it was given by path by the file's name alone
        raise SystemExit(
            f"bench: the daemon serves {health['model']!r}, which this machine does not resolve by that name; "
            "pass --model with its path (whose tokenizer makes the prompts)"
        ) from None
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    corpus = tokenizer.encode(" ".join(json.loads(line)["prompt"] for line in CHAT_SET.read_text().splitlines()))
    modes = args.modes.split(",") if native else ["server"]
    via = tokenizer if args.api == "messages" else None
    pts = points(args)
    largest = max(p[1] for p in pts)  # the point whose TTFT distribution is plotted
    total = len(pts) * args.repeats * len(modes) * args.requests
    rows, ttft, timelines, labels = [], {}, {}, set()
    progress = tqdm(total=total, desc="requests", unit="req", file=sys.stderr)
    async with session(**target) as s:
        for kind, x, over in pts:
            arrivals = over.get("arrivals", args.arrivals)
            concurrency = over.get("concurrency", args.concurrency)
            olen = over.get("output_len", args.output_len)
            if args.workload == "chat":
                trace = chat_trace(args.requests, arrivals, args.seed)
            else:
                trace = synthetic_trace(args.requests, args.prompt_len, olen, arrivals, args.seed, corpus)
            if kind == "variance":
                x = statistics.pstdev(it.max_tokens for it in trace)
            label = {"main": "main", "concurrency": f"c={x}", "rate": f"{x} req/s", "variance": f"sd={x:.0f}"}[kind]
            if label in labels:  # two spreads whose few requests drew the same sd: the points stay apart
                label += f" (outputs {olen[0]}-{olen[1]})"
            labels.add(label)
            warm = trace[: args.warmup]
            texts: dict[str, list[str | None]] = {}  # each mode's first run: every request's text
            for mode in modes:
                runs, engines = [], []
                for rep in range(args.repeats):
                    if native:
                        await wait_mode(s, mode)
                    if warm:
                        await replay(
                            s,
                            [TraceItem(0.0, w.prompt_ids, w.messages, min(8, w.max_tokens)) for w in warm],
                            None,
                            native=native,
                            tokenizer=via,
                        )
                    record = native and rep == 0 and x == largest
                    before = (await steps_since(s, 1 << 62))["last_step"] if record else 0
                    results, wall, engine = await replay(s, trace, concurrency, progress, native=native, tokenizer=via)
                    if record:  # the largest point's step records, both modes: scripts/timeline.py --json draws them
                        data = await steps_since(s, before)
                        data["truncated"] = bool(data["steps"]) and data["steps"][0]["step"] > before + 1
                        timelines[mode] = data | {"point": label}
                    summary = summarize(results, wall, args.slo_ttft, args.slo_tpot)
                    runs.append(summary)
                    if rep == 0:
                        texts[mode] = [r.text if r.ok else None for r in results]
                    engines.append(engine)
                    if kind in ("main", "concurrency") and x == largest:
                        ttft.setdefault(mode, []).extend(
                            r.ttft for r in results if r.ok
                        )  # main run, or the largest point
                    (out / f"run-{kind}-{label.replace(' ', '').replace('/', '')}-{mode}-{rep}.json").write_text(
                        json.dumps(
                            {
                                "point": label,
                                "mode": mode,
                                "summary": summary,
                                "engine": engine,
                                "requests": [asdict(r) | {"itl": r.itl} for r in results],
                            },
                            default=str,
                        )
                    )
                engine = {k: statistics.median(e[k] for e in engines) for k in engines[0]} if native else {}
                rows.append(
                    {
                        "kind": kind,
                        "x": x,
                        "point": label,
                        "variant": mode,
                        "summary": median_summary(runs),
                        "engine": engine,
                    }
                )
            if len(texts) > 1:  # the same answers whatever the mode: static and continuous differ in time alone
                same = sum(len(set(t)) == 1 and t[0] is not None for t in zip(*texts.values()))
                for r in rows[-len(texts) :]:
                    r["same_texts"] = [same, len(trace)]
            if args.hf_baseline:
                rows.append(
                    {
                        "kind": kind,
                        "x": x,
                        "point": label,
                        "variant": "hf-static",
                        "summary": hf_static(str(model_dir), trace, concurrency or args.max_batch, tokenizer),
                        "engine": {},
                    }
                )
    progress.close()
    ceilings = machine_ceilings(health.get("memory"))
    md = table(rows)
    (out / "table.md").write_text(md + "\n")
    (out / "summary.json").write_text(
        json.dumps(
            {"args": vars(args), "daemon": health, "ceilings": ceilings, "rows": rows, "timeline": timelines},
            indent=2,
            default=str,
        )
    )
    made = plots(rows, ttft, out)
    print(md)
    print("\n" + ceilings_line(ceilings))
    for m in made:
        print(f"plot: {m}")
    fails = sum(r["summary"]["failed"] for r in rows)
    return 0 if fails == 0 else 1


async def run_peers(args, out: Path) -> int:
    from peers import compare
    from peers.compare import WorkMismatch

    from minibatch.engine.store.cache import BUILTIN_MODELS, builtin_gguf_path, resolve_model

    if args.model is not None:  # one file for every server
        args.gguf, args.peer_model = args.model, args.model
    args.gguf = builtin_gguf_path(BUILTIN_MODELS["smollm2-135m-instruct"]) if args.gguf is None else Path(args.gguf)
    args.hf_dir = str(resolve_model(args.peer_model))
    try:
        rows = await compare.compare(args, body_of)
    except WorkMismatch as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    md = compare.table(rows)
    (out / "peers.md").write_text(md + "\n")
    (out / "peers.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1, default=str))
    print(md)
    for line in compare.ratios(rows):
        print(line)
    print(f"plot: {compare.plot(rows, out / 'peers_throughput.png')}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--socket", default=None)
    ap.add_argument(
        "--model",
        default=None,
        help="model for the tokenizer and HF baseline (default: the daemon's); "
        "with --peers, the .gguf every server runs",
    )
    ap.add_argument("--workload", choices=["synthetic", "chat"], default="synthetic")
    ap.add_argument(
        "--api",
        choices=APIS,
        default="openai",
        help="openai: /v1/completions (synthetic) and /v1/chat/completions (chat); messages: Anthropic's "
        "/v1/messages for every request (the relay's own cost, on the same trace)",
    )
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=lambda v: tuple(map(int, v.split(","))), default=(32, 256))
    ap.add_argument(
        "--output-len",
        type=lambda v: tuple(map(int, v.split(","))),
        default=None,
        help="output tokens, min,max (default 16,256; with --peers 8,128)",
    )
    ap.add_argument("--arrivals", default="all", help="all, poisson:RATE or gamma:RATE:CV")
    ap.add_argument("--concurrency", type=int, default=None, help="at most this many in flight (default: unlimited)")
    ap.add_argument("--modes", default="continuous,static")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--natural",
        action="store_true",
        help="no ignore_eos: every answer ends where the model ends it (the trace's lengths become caps)",
    )
    ap.add_argument(
        "--sampling",
        choices=list(sampling_presets()),
        default="greedy",
        help="what every request samples with: greedy, the chat's defaults or Ollama's (peers included; "
        "each sampled request with a seed of its own)",
    )
    ap.add_argument("--slo-ttft", type=float, default=None, help="goodput SLO: TTFT at most this many seconds")
    ap.add_argument("--slo-tpot", type=float, default=None, help="goodput SLO: TPOT at most this many seconds")
    ap.add_argument("--sweep", default=None, help="concurrency:1,4,16 | rate:0.5,1,2 | variance")
    ap.add_argument(
        "--hf-baseline", action="store_true", help="also run HF generate in padded static batches (in-process)"
    )
    ap.add_argument("--max-batch", type=int, default=32, help="HF baseline batch size when no concurrency is set")
    ap.add_argument("--out", default="results/bench")
    ap.add_argument(
        "--url", default=None, help="benchmark any OpenAI-compatible server at this URL instead of the socket"
    )
    ap.add_argument("--api-key", default=None, help="API key to send (default: $MINIBATCH_API_KEY)")
    peers = ap.add_argument_group(
        "peers (--peers): the same text trace against minibatchd and other servers, one at a time"
    )
    peers.add_argument(
        "--peers",
        default=None,
        help="comma list of minibatch[:native|native-exact|float32], llama.cpp[:file|Q4_1|Q8_0|F32], vllm, hf",
    )
    peers.add_argument("--concurrencies", default="1,4,16,64", help="closed-loop concurrency points")
    peers.add_argument("--repeat-at", default="1,16", help="points measured --repeats times (median); others once")
    peers.add_argument(
        "--per-client",
        type=int,
        default=0,
        help="at concurrency c, at least this many requests per client (the trace grows to c x N), "
        "so that c clients are really in flight",
    )
    peers.add_argument("--words", type=lambda v: tuple(map(int, v.split(","))), default=(16, 64), help="prompt words")
    peers.add_argument("--llama-server", default=None, help="llama-server binary (else $LLAMA_SERVER or PATH)")
    peers.add_argument(
        "--gguf", default=None, help="the Q4_1 GGUF the llama.cpp variants start from (default: built-in)"
    )
    peers.add_argument("--peer-model", default="smollm2-135m-instruct", help="model minibatchd serves")
    peers.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of every server")
    peers.add_argument("--port", type=int, default=18931, help="loopback port for TCP peers")
    peers.add_argument("--ctx-per-slot", type=int, default=512, help="llama.cpp context per slot (>= longest request)")
    args = ap.parse_args()
    args.socket = env_socket(args.socket)
    SAMPLING.clear()
    SAMPLING.update(sampling_presets()[args.sampling])
    if args.natural:
        LENGTHS.clear()
    if args.output_len is None:
        args.output_len = (8, 128) if args.peers else (16, 256)
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())

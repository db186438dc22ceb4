"""Code completion as you type: an editing session replayed against minibatchd's and llama-server's /infill.

  .venv/bin/python scripts/features/bench_infill.py --gguf models/coder05b.gguf --llama-server /path/to/llama-server
  .venv/bin/python scripts/features/bench_infill.py --gguf models/coder05b.gguf --editors 1 --sites 3 --variants reuse

The session is the one an editor plugin (llama.vscode) makes of a developer editing a real source file, the
standard library's argparse.py (2,600 lines): the cursor goes down the file a few lines at a time; at each
place the developer retypes the line word by word, and at each pause (after a word) the plugin asks /infill
for the middle: the 60 lines before the cursor (`input_prefix`), the line typed so far (`prompt`), the 20
lines after (`input_suffix`), and two 64-line chunks of two other files (`input_extra`, as the plugin's ring
of recently seen code sends them). Each editor waits for its suggestion (streamed, --n-predict tokens at the
plugin's sampling: top_k 40, top_p 0.99, a seed per request, ignore_eos so every server writes as many), then
types the next word after --pause seconds. With --editors N, N developers at N places of the file at once.
The first request of each editor (nothing to reuse anywhere) is left out of the figures.

The burst (--burst K): at a fresh place, after the line's first suggestion, K characters are typed --burst-gap
seconds apart, each one a request that abandons the one before (its connection closed, as a plugin does);
the last one's time to first token beside a lone one's (the same K-th character's request, sent once the
place's first suggestion is in, at the next place along, alternating; medians).

Time to first token is the client's: from sending to the first streamed token (llama-server streams a chunk
per token, and so does minibatchd's /infill). Variants: minibatchd as it starts by default (its shifted reuse
on: --cache-reuse 256), minibatchd --cache-reuse 0, llama-server as it starts by default, and llama-server
--cache-reuse 256 (its slots one per editor, each with the context minibatchd's requests get).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_agent import LlamaServer, Minibatchd  # noqa: E402

PREFIX_LINES, SUFFIX_LINES, CHUNK_LINES = 60, 20, 64
EXTRA = (("textwrap", 100), ("shlex", 20))  # (module, first line) of the two chunks of other files
VARIANTS = ("reuse", "noreuse", "llama", "llama-reuse")
NAMES = {
    "reuse": "minibatchd",
    "noreuse": "minibatchd --cache-reuse 0",
    "llama": "llama-server",
    "llama-reuse": "llama-server --cache-reuse 256",
}


@dataclass(frozen=True)
class Keystroke:
    prefix: str
    prompt: str
    suffix: str


def source(module: str) -> list[str]:
    import importlib

    return Path(importlib.import_module(module).__file__).read_text().splitlines(keepends=True)


def extra_chunks() -> list[dict]:
    return [
        {"filename": f"{name}.py", "text": "".join(source(name)[first : first + CHUNK_LINES])} for name, first in EXTRA
    ]


def next_site(lines: list[str], line: int) -> int:
    """The first line from `line` on with three words or more to type."""
    while len(lines[line].split()) < 3:
        line += 1
    return line


def keystrokes(lines: list[str], line: int, words: int) -> list[Keystroke]:
    """Line `line` retyped: a request after each of its first `words` words."""
    indent = lines[line][: len(lines[line]) - len(lines[line].lstrip())]
    parts = lines[line].split()
    prefix = "".join(lines[max(0, line - PREFIX_LINES) : line])
    suffix = "\n" + "".join(lines[line + 1 : line + 1 + SUFFIX_LINES])
    return [Keystroke(prefix, indent + " ".join(parts[:k]) + " ", suffix) for k in range(1, min(words, len(parts)) + 1)]


def characters(lines: list[str], line: int, count: int) -> list[Keystroke]:
    """Line `line` retyped a character at a time: a request after each of its first `count` characters."""
    text = lines[line].rstrip("\n")
    indent = len(text) - len(text.lstrip())
    prefix = "".join(lines[max(0, line - PREFIX_LINES) : line])
    suffix = "\n" + "".join(lines[line + 1 : line + 1 + SUFFIX_LINES])
    return [Keystroke(prefix, text[: indent + k], suffix) for k in range(1, count + 1)]


def body(key: Keystroke, extra: list[dict], n_predict: int, seed: int) -> dict:
    return {"input_prefix": key.prefix, "prompt": key.prompt, "input_suffix": key.suffix, "input_extra": extra,
            "n_predict": n_predict, "top_k": 40, "top_p": 0.99, "seed": seed, "ignore_eos": True, "stream": True,
            "cache_prompt": True}  # fmt: skip


async def ask(server, payload: dict) -> dict:
    """One streamed /infill: the client's time to the first token and to the last, the server's counts."""
    url = server.url.rsplit("/v1/", 1)[0] + "/infill"
    start = time.monotonic()
    first = last = None
    async with server.session() as s:
        async with s.post(url, json=payload) as resp:
            if resp.status != 200:
                raise SystemExit(f"{url}: {resp.status} {await resp.text()}")
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise SystemExit(f"{url}: {event['error']}")
                if first is None and event.get("tokens_predicted"):
                    first = time.monotonic() - start
                last = event
    return {"ttft": first, "total": time.monotonic() - start, "prompt_tokens": last["tokens_evaluated"],
            "cached": last.get("tokens_cached", 0), "predicted": last["tokens_predicted"]}  # fmt: skip


async def editor(server, lines, line: int, args, extra, seed: int) -> list[dict]:
    rows = []
    for _ in range(args.sites):
        line = next_site(lines, line)
        for k, key in enumerate(keystrokes(lines, line, args.words)):
            row = await ask(server, body(key, extra, args.n_predict, seed + len(rows)))
            rows.append(row | {"line": line, "word": k + 1})
            await asyncio.sleep(args.pause)
        line += args.step
    return rows


async def burst(server, lines, line: int, args, extra) -> dict:
    """Alternating places: a lone K-th keystroke, then a burst of K ending in one; medians of each."""
    lone, last = [], []
    for rep in range(2 * args.burst_places):
        line = next_site(lines, line)
        while len(lines[line].strip()) <= args.burst:
            line = next_site(lines, line + 1)
        keys = characters(lines, line, args.burst)
        start = keystrokes(lines, line, 1)[0]
        await ask(server, body(Keystroke(start.prefix, keys[0].prompt[:-1], start.suffix), extra, args.n_predict, 7))
        if rep % 2 == 0:
            lone.append((await ask(server, body(keys[-1], extra, args.n_predict, 8)))["ttft"])
        else:
            pending = None
            for key in keys[:-1]:
                if pending is not None:
                    pending.cancel()
                pending = asyncio.ensure_future(ask(server, body(key, extra, args.n_predict, 8)))
                await asyncio.sleep(args.burst_gap)
            pending.cancel()
            last.append((await ask(server, body(keys[-1], extra, args.n_predict, 8)))["ttft"])
        line += args.step
    return {"lone_ttft": lone, "burst_last_ttft": last}


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def summary(rows: list[dict]) -> dict:
    ttft, total = [r["ttft"] for r in rows], [r["total"] for r in rows]
    return {"requests": len(rows), "ttft_p50": pct(ttft, 50), "ttft_p95": pct(ttft, 95),
            "total_p50": pct(total, 50), "total_p95": pct(total, 95),
            "prompt_tokens": statistics.mean(r["prompt_tokens"] for r in rows),
            "cached": statistics.mean(r["cached"] for r in rows)}  # fmt: skip


def server_for(variant: str, editors: int, args, workdir: Path):
    if variant.startswith("llama"):
        server = LlamaServer(args)
        at = server.argv.index("-np")
        server.argv[at + 1] = str(editors)
        server.argv[server.argv.index("-c") + 1] = str(args.ctx * editors)
        if variant == "llama-reuse":
            server.argv += ["--cache-reuse", "256"]
        return server
    server = Minibatchd(args, 8.0, workdir / "prompt-cache", workdir)
    at = server.argv.index("--speculative")
    del server.argv[at : at + 2]  # its default
    server.argv[server.argv.index("--kv-cache-tokens") + 1] = str(args.ctx * max(editors, 4))
    server.argv += ["--cache-reuse", str(args.cache_reuse) if variant == "reuse" else "0"]
    return server


def run_variant(variant: str, editors: int, args, lines, extra) -> dict:
    with tempfile.TemporaryDirectory(prefix="mb-infill-", dir="/tmp") as d:
        server = server_for(variant, editors, args, Path(d))
        server.start()
        try:

            async def session():
                spread = (len(lines) - 400) // max(1, editors)
                starts = [args.first_line + e * spread for e in range(editors)]
                runs = await asyncio.gather(
                    *(editor(server, lines, s, args, extra, 1000 * e) for e, s in enumerate(starts))
                )
                rows = [r for run in runs for r in run[1:]]  # (each editor's first request: nothing to reuse)
                b = {}
                if args.burst and editors == 1:  # (the burst is one editor's)
                    b = await burst(server, lines, starts[0] + args.sites * args.step + 40, args, extra)
                return rows, b

            rows, b = asyncio.run(session())
        finally:
            server.stop()
    out = {"variant": variant, "server": NAMES[variant], "editors": editors, "rows": rows} | summary(rows) | b
    print(f"  {NAMES[variant]:32s} {editors} editor(s): TTFT p50 {out['ttft_p50']:.2f} s p95 {out['ttft_p95']:.2f} s, "
          f"whole p50 {out['total_p50']:.2f} s p95 {out['total_p95']:.2f} s, prompt {out['prompt_tokens']:.0f} "
          f"cached {out['cached']:.0f} tokens", flush=True)  # fmt: skip
    if b:
        print(f"    burst of {args.burst}: last TTFT {statistics.median(b['burst_last_ttft']):.2f} s, lone "
              f"{statistics.median(b['lone_ttft']):.2f} s", flush=True)  # fmt: skip
    return out


TIMES = ("ttft_p50", "ttft_p95", "total_p50", "total_p95")


def table(results: list[dict]) -> str:
    lines = ["| server | editors | requests | TTFT p50 s | TTFT p95 s | whole p50 s | whole p95 s | prompt tokens | "
             "reused or cached |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in results:
        cells = [r["server"], r["editors"], r["requests"], *(f"{r[k]:.2f}" for k in TIMES),
                 f"{r['prompt_tokens']:.0f}", f"{r['cached']:.0f}"]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    editors = sorted({r["editors"] for r in results})
    fig, axes = plt.subplots(1, len(editors), figsize=(5.2 * len(editors), 3.8), squeeze=False)
    for ax, n in zip(axes[0], editors):
        for r in (r for r in results if r["editors"] == n):
            ttft = sorted(row["ttft"] for row in r["rows"])
            ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=r["server"])
        ax.set_xscale("log")
        ax.set_xlabel("time to first token, s")
        ax.set_ylabel("share of requests")
        ax.set_title(f"{n} editor{'s' if n > 1 else ''}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def agreement(args, lines, extra) -> list[dict]:
    """What reuse does to the answers: the session's requests (one editor), greedy, by in-process engines of the
    built-in model (real weights; it was not trained to fill in the middle, so three of its unused special tokens
    stand for the markers), with --cache-reuse 0 (every position computed as the prompt says: the reference),
    with an f16 cache instead of q8_0 (a yardstick: how far an exact computation's rounding alone moves the
    answers), with n-gram speculation (its drafts come from the prompt, the code after the cursor included: the
    same answers, its decode time beside the reference's) and with each of --agreement's minimum runs (as the
    engine runs them, the first 16 tokens of a run after a change computed; and "settle 0": every matched token
    moved); the share of suggestions equal to the reference's, whole and in their first token."""
    from minibatch.engine.core.sampling_params import SamplingParams
    from minibatch.engine.factory import EngineConfig, build_engine
    from minibatch.engine.text.fim import FimTokens, Infill, assemble

    variants = {"reference": {"cache_reuse": 0}, "f16 cache": {"cache_reuse": 0, "kv_cache_type": "f16"}}
    variants["ngram speculation"] = {"cache_reuse": 0, "speculative": "ngram"}  # (drafts from the prompt's suffix)
    for m in args.agreement.split(","):  # each minimum run as it runs, and with every moved run's tokens moved
        variants[f"--cache-reuse {m}"] = {"cache_reuse": int(m)}
        variants[f"--cache-reuse {m}, settle 0"] = {"cache_reuse": int(m), "cache_reuse_settle": 0}
    base = {"model": "smollm2-135m-instruct", "speculative": "off", "kv_cache_tokens": args.ctx * 4,
            "max_model_len": args.ctx}  # fmt: skip
    engines = {name: build_engine(EngineConfig(**{**base, **kw})) for name, kw in variants.items()}
    tok = engines["reference"].tokenizer
    fim = FimTokens(prefix=8, suffix=9, middle=10, repo=3, file_sep=5)  # <issue_start>, <issue_comment>, ...
    chunks = [(c["filename"], c["text"]) for c in extra]
    keys, line = [], args.first_line
    for _ in range(args.sites):
        line = next_site(lines, line)
        keys += keystrokes(lines, line, args.words)
        line += args.step
    prompts = [assemble(fim, tok.encode, Infill(k.prefix, k.suffix, k.prompt, chunks), args.ctx, 16) for k in keys]
    answers = {}
    for m, engine in engines.items():
        answers[m] = []
        for i, prompt in enumerate(prompts):
            params = SamplingParams(temperature=0.0, max_tokens=args.n_predict, ignore_eos=True)
            engine.add_request(f"a{i}", prompt, params, reuse_shifted=True)
            tokens, metrics = [], None
            while engine.has_work():
                outs, _ = engine.step()
                for o in outs:
                    tokens += o.token_ids
                    metrics = o.metrics if o.finished else metrics
            answers[m].append((tokens, metrics))
    rows = []
    for m in list(engines)[1:]:
        pairs = list(zip(answers["reference"], answers[m]))[1:]  # (the first request: nothing to reuse)
        same = sum(a == b for (a, _), (b, _) in pairs)
        first = sum(a[:1] == b[:1] for (a, _), (b, _) in pairs)
        reused = statistics.mean(m.reused_prompt_tokens for _, (_, m) in pairs)
        decode = sum(m.decode_time or 0 for _, (_, m) in pairs) / sum(r.decode_time or 0 for (_, r), _ in pairs)
        drafted, accepted = (sum(getattr(m, k) for _, (_, m) in pairs) for k in ("draft_tokens", "accepted_tokens"))
        rows.append({"variant": m, "requests": len(pairs), "same_suggestion": same / len(pairs),
                     "same_first_token": first / len(pairs), "reused_tokens": reused,
                     "prompt_tokens": statistics.mean(len(p) for p in prompts), "decode_time_ratio": decode,
                     "acceptance": accepted / drafted if drafted else None})  # fmt: skip
        print(f"  {m}: {same}/{len(pairs)} suggestions as computed, first token {first}/{len(pairs)}, "
              f"{reused:.0f} of {rows[-1]['prompt_tokens']:.0f} prompt tokens reused, decode time {decode:.2f}x"
              + (f", {accepted}/{drafted} draft tokens accepted" if drafted else ""), flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help="the model: a coder GGUF with fill-in-the-middle tokens (minibatchd alone also takes a model directory)",
    )
    ap.add_argument("--agreement", default=None, help="MIN,MIN...: only the answers' agreement with reuse off")
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--ctx", type=int, default=4096, help="context tokens per editor")
    ap.add_argument("--editors", default="1,4")
    ap.add_argument("--sites", type=int, default=6, help="places each editor retypes a line at")
    ap.add_argument("--words", type=int, default=5, help="requests per place (one per word typed)")
    ap.add_argument("--step", type=int, default=9, help="lines the cursor moves down between places")
    ap.add_argument("--first-line", type=int, default=300)
    ap.add_argument("--pause", type=float, default=0.3, help="seconds between a suggestion and the next word")
    ap.add_argument("--n-predict", type=int, default=16)
    ap.add_argument("--burst", type=int, default=20, help="characters of the burst (0: none)")
    ap.add_argument("--burst-gap", type=float, default=0.08)
    ap.add_argument("--burst-places", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--cache-reuse", type=int, default=None, help="minibatchd's --cache-reuse (default: its own)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.cache_reuse is None:
        from minibatch.engine.core.config import SCHEDULER_DEFAULTS

        args.cache_reuse = SCHEDULER_DEFAULTS["cache_reuse"]
    NAMES["reuse"] = f"minibatchd --cache-reuse {args.cache_reuse}"
    lines, extra = source("argparse"), extra_chunks()
    if args.agreement:
        rows = agreement(args, lines, extra)
        if args.json:
            args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "agreement": rows}))
        return 0
    if args.gguf is None:
        ap.error("--gguf is required (a coder model with fill-in-the-middle tokens)")
    results = []
    for n in (int(x) for x in args.editors.split(",")):
        for variant in filter(None, args.variants.split(",")):
            if variant.startswith("llama") and not args.llama_server:
                continue
            if variant in ("noreuse", "llama") and n > 1:
                continue  # (the targets are against the best of each; the defaults without reuse at one editor)
            results.append(run_variant(variant, n, args, lines, extra))
    print("\n" + table(results))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

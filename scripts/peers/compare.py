"""`bench.py --peers`: one recorded trace against minibatchd and each peer, one server at a time.

Each server is started for each concurrency point (llama.cpp with -np equal to
the concurrency, minibatchd with --max-num-seqs equal to it), warmed with two
short requests, sent the same text prompts through /v1/completions with output
lengths forced by max_tokens + ignore_eos, and stopped. Every response's
completion_tokens must equal what the trace asked: a server that generated a
different count fails the run, since its numbers would measure other work.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import psutil

from . import Launch, Running, llamacpp, minibatch, server_pid, vllm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchlib import TraceItem, median_summary, summarize, text_trace  # noqa: E402
from loadgen import Result, session, stream_request  # noqa: E402


class WorkMismatch(RuntimeError):
    """A server generated a different number of tokens than the trace asked for."""


def check_counts(trace: list[TraceItem], results: list[Result], server: str) -> None:
    bad = [
        (i, it.max_tokens, r.output_tokens, r.error)
        for i, (it, r) in enumerate(zip(trace, results))
        if not r.ok or r.output_tokens != it.max_tokens
    ]
    if bad:
        lines = "\n".join(
            f"  request {i}: asked {want}, got {got}" + (f" ({err})" if err else "") for i, want, got, err in bad[:10]
        )
        raise WorkMismatch(
            f"{server}: {len(bad)} of {len(trace)} responses did not generate the tokens asked for:\n{lines}"
        )


async def replay_http(
    target: dict, trace: list[TraceItem], concurrency: int, body_of, model: str | None = None
) -> tuple[list[Result], float]:
    """Closed loop: at most `concurrency` requests in flight, in trace order."""
    sem = asyncio.Semaphore(max(1, concurrency))
    async with session(**target) as s:

        async def one(i: int, item: TraceItem) -> Result:
            async with sem:
                body, chat = body_of(item, i)
                return await stream_request(s, i, {**body, "model": model} if model else body, chat)

        start = time.monotonic()
        results = await asyncio.gather(*(one(i, it) for i, it in enumerate(trace)))
        return list(results), time.monotonic() - start


async def wait_ready(running: Running, target: dict, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if running.proc.poll() not in (None, 0):
            raise RuntimeError(f"{running.launch.name} exited with {running.proc.returncode}:\n{running.log_tail()}")
        try:
            async with session(**target) as s:
                async with s.get("/health") as r:
                    if r.status == 200:
                        return
        except OSError:
            pass
        await asyncio.sleep(0.25)
    raise RuntimeError(f"{running.launch.name} was not ready within {timeout:.0f} s:\n{running.log_tail()}")


class RssSampler:
    """Peak resident memory of the serving process while it runs."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.peak = 0

    async def run(self) -> None:
        while True:
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return
            await asyncio.sleep(0.2)


def launch_for(spec: str, args, concurrency: int, workdir: Path) -> Launch:
    kind, _, variant = spec.partition(":")
    ctx = args.ctx_per_slot
    if kind == "llama.cpp":
        return llamacpp.launch(
            variant or "file", args.gguf, args.port, concurrency, args.threads, ctx, args.llama_server
        )
    if kind == "minibatch":
        kv_tokens = max(1, concurrency) * ctx  # the token slots llama.cpp gets
        return minibatch.launch(
            str(workdir / f"mb-{variant or 'native'}.sock"),
            variant or "native",
            concurrency,
            args.threads,
            args.peer_model,
            kv_tokens,
        )
    if kind == "vllm":
        return vllm.launch(args.hf_dir, args.port, concurrency, ctx)
    raise SystemExit(
        f"unknown peer {spec!r}: minibatch[:native|native-exact|float32], llama.cpp[:file|Q4_1|Q8_0|F32], vllm, hf"
    )


async def measure(launch: Launch, traces: list[list[TraceItem]], concurrency: int, body_of, workdir: Path) -> dict:
    """One server at one concurrency: each trace replayed once (a run each), the median of the runs."""
    target = {"url": launch.url} if launch.url else {"socket": launch.socket}
    running = Running(launch, workdir / f"{launch.name.replace(' ', '_')}-c{concurrency}.log")
    try:
        await wait_ready(running, target)
        sampler = RssSampler(server_pid(running))
        task = asyncio.create_task(sampler.run())
        warm = [TraceItem(0.0, None, None, 4, "Hello there, how are you today?")] * 2
        await replay_http(target, warm, 1, body_of, launch.model)
        runs = []
        for trace in traces:
            results, wall = await replay_http(target, trace, concurrency, body_of, launch.model)
            check_counts(trace, results, launch.name)
            runs.append(summarize(results, wall))
        task.cancel()
        await asyncio.sleep(1.0)  # idle: what the server keeps once it has served
        rss_after = sampler.proc.memory_info().rss
        return {
            "server": launch.name,
            "concurrency": concurrency,
            "repeats": len(traces),
            "info": launch.info,
            "rss_peak_mb": sampler.peak / 2**20,
            "rss_after_mb": rss_after / 2**20,
            "summary": median_summary(runs),
        }
    finally:
        running.stop()


def hf_point(args, trace: list[TraceItem], concurrency: int) -> dict:
    """Hugging Face generate in padded static batches of `concurrency`, in this process."""
    from bench import hf_static
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.hf_dir)
    ids_trace = [TraceItem(0.0, tok.encode(it.prompt_text), None, it.max_tokens) for it in trace]
    return {
        "server": "HF generate (static)",
        "concurrency": concurrency,
        "repeats": 1,
        "info": {},
        "rss_peak_mb": psutil.Process().memory_info().rss / 2**20,
        "summary": hf_static(args.hf_dir, ids_trace, concurrency, tok),
    }


def point_traces(args, run: int = 0) -> dict[int, list[TraceItem]]:
    """The trace of each concurrency point for repeat `run`: the first max(requests, c x per_client) items of
    one trace, so every point starts with the same requests and c clients are really in flight. Each
    repeat has prompts of its own (the seed plus the run): a server that keeps past prompts (llama-server's
    --cache-ram, 8 GiB by default since 2025) would otherwise answer the second run from memory."""
    concurrencies = [int(c) for c in args.concurrencies.split(",")]
    sizes = {c: max(args.requests, c * getattr(args, "per_client", 0)) for c in concurrencies}
    full = text_trace(max(sizes.values()), args.words, args.output_len, args.seed + run)
    return {c: full[:n] for c, n in sizes.items()}


async def compare(args, body_of) -> list[dict]:
    runs = [point_traces(args, run) for run in range(max(args.repeats, 1))]
    traces = runs[0]
    repeat_at = {int(c) for c in args.repeat_at.split(",") if c}
    rows: list[dict] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mbpeer-", dir="/tmp") as tmp:
        workdir = Path(tmp)
        for c, trace in traces.items():
            for spec in args.peers.split(","):
                reps = args.repeats if c in repeat_at else 1
                print(
                    f"-- {spec} at concurrency {c} ({reps} run{'s' if reps > 1 else ''})", file=sys.stderr, flush=True
                )
                if spec == "hf":
                    row = hf_point(args, trace, c)
                else:
                    row = await measure(
                        launch_for(spec, args, c, workdir), [r[c] for r in runs[:reps]], c, body_of, workdir
                    )
                row["requests"] = len(trace)
                rows.append(row)
                (out / "peers.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2, default=str))
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| concurrency | requests | server | out tok/s | TTFT p50 / p95 (s) | e2e p95 (s) | RSS peak / after (MB) "
        "| runs |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s = r["summary"]
        ttft = s["ttft"]
        t = "-" if ttft["p50"] is None else f"{ttft['p50']:.2f} / {ttft['p95']:.2f}"
        lines.append(
            f"| {r['concurrency']} | {r.get('requests', '-')} | {r['server']} | {s['output_throughput']:.1f} | {t} | "
            f"{s['e2e']['p95']:.1f} | {r['rss_peak_mb']:.0f} / {r.get('rss_after_mb', float('nan')):.0f} | "
            f"{r['repeats']} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for server in dict.fromkeys(r["server"] for r in rows):
        pts = sorted((r["concurrency"], r["summary"]["output_throughput"]) for r in rows if r["server"] == server)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=server)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ratios(rows: list[dict]) -> list[str]:
    """minibatch native / the better llama.cpp variant, per concurrency."""
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        at = {r["server"]: r["summary"]["output_throughput"] for r in rows if r["concurrency"] == c}
        ours = at.get("minibatch native")
        peers = {k: v for k, v in at.items() if k.startswith("llama.cpp")}
        if ours and peers:
            best = max(peers, key=peers.get)
            out.append(
                f"c={c}: minibatch native {ours:.1f} tok/s = {ours / peers[best]:.2f}x {best} ({peers[best]:.1f})"
            )
    return out

"""Workloads, arrivals and metrics for scripts/bench.py (plain Python, tested in tests/scripts)."""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

from loadgen import Result, percentile

CHAT_SET = Path(__file__).resolve().parent / "data" / "chat_prompts.jsonl"


def sampling_presets() -> dict[str, dict]:
    """The sampling a benchmark's requests ask for (--sampling): greedy, the chat's pane defaults (its own
    PaneSettings), and Ollama's documented defaults (temperature 0.8, top_k 40, top_p 0.9)."""
    from minibatch.tui.history import PaneSettings

    return {
        "greedy": {"temperature": 0.0},
        "chat": PaneSettings().request_params(),
        "ollama": {"temperature": 0.8, "top_k": 40, "top_p": 0.9},
    }


@dataclass(slots=True, frozen=True)
class TraceItem:
    """One request of a trace: when it is sent (s after start), what, and how many tokens it must generate."""

    at: float
    prompt_ids: list[int] | None  # synthetic: exact token ids (sent to /v1/completions)
    messages: list[dict] | None  # chat set: a conversation (sent to /v1/chat/completions)
    max_tokens: int
    prompt_text: str | None = None  # peers: plain text (sent to /v1/completions of any server)


def arrival_times(n: int, spec: str, seed: int) -> list[float]:
    """`all` (t=0), `poisson:RATE` or `gamma:RATE:CV` (CV > 1 is burstier than Poisson) in requests/s."""
    rng = random.Random(seed)
    kind, *rest = spec.split(":")
    if kind in ("all", "concurrency"):
        return [0.0] * n
    rate = float(rest[0])
    if rate <= 0:
        raise ValueError(f"arrival rate must be positive, got {rate}")
    if kind == "poisson":
        gaps = [rng.expovariate(rate) for _ in range(n)]
    elif kind == "gamma":
        cv = float(rest[1]) if len(rest) > 1 else 1.0
        shape = 1 / (cv * cv)
        gaps = [rng.gammavariate(shape, 1 / (rate * shape)) for _ in range(n)]
    else:
        raise ValueError(f"unknown arrival spec {spec!r}: all, concurrency:N, poisson:RATE or gamma:RATE:CV")
    out, t = [], 0.0
    for g in gaps:
        out.append(t)
        t += g
    return out


def synthetic_trace(
    n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], arrivals: str, seed: int, corpus_ids: list[int]
) -> list[TraceItem]:
    """Prompts of exact token lengths cut from real tokenized text; output lengths drawn in range."""
    rng = random.Random(seed)
    times = arrival_times(n, arrivals, seed + 1)
    items = []
    for i in range(n):
        length = rng.randint(*prompt_len)
        start = rng.randrange(0, max(1, len(corpus_ids) - length))
        ids = (corpus_ids * (1 + length // max(1, len(corpus_ids))))[start : start + length]
        items.append(TraceItem(times[i], ids, None, rng.randint(*output_len)))
    return items


def text_trace(
    n: int, words: tuple[int, int], output_len: tuple[int, int], seed: int, path: Path = CHAT_SET
) -> list[TraceItem]:
    """Plain-text prompts of `words` words cut from the chat set, for servers with their own tokenizers."""
    rows = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    corpus = " ".join(rows).split()
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        length = rng.randint(*words)
        start = rng.randrange(0, len(corpus) - length)
        items.append(TraceItem(0.0, None, None, rng.randint(*output_len), " ".join(corpus[start : start + length])))
    return items


def chat_trace(n: int, arrivals: str, seed: int, path: Path = CHAT_SET) -> list[TraceItem]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    times = arrival_times(n, arrivals, seed + 1)
    picks = [rows[rng.randrange(len(rows))] for _ in range(n)]
    return [
        TraceItem(t, None, [{"role": "user", "content": r["prompt"]}], r["max_tokens"]) for t, r in zip(times, picks)
    ]


def summarize(results: list[Result], wall: float, slo_ttft: float | None = None, slo_tpot: float | None = None) -> dict:
    """Latency percentiles (seconds), throughput, goodput (requests meeting every SLO, per second), failures."""
    ok = [r for r in results if r.ok]

    def stats(values: list[float | None]) -> dict:
        vals = [v for v in values if v is not None]
        if not vals:
            return {"mean": None, "p50": None, "p95": None, "p99": None}
        return {
            "mean": statistics.fmean(vals),
            "p50": percentile(vals, 50),
            "p95": percentile(vals, 95),
            "p99": percentile(vals, 99),
        }

    def good(r: Result) -> bool:
        return (slo_ttft is None or (r.ttft is not None and r.ttft <= slo_ttft)) and (
            slo_tpot is None or r.tpot is None or r.tpot <= slo_tpot
        )

    out_tokens = sum(r.output_tokens for r in ok)
    normalized = [r.e2e / r.output_tokens for r in ok if r.e2e is not None and r.output_tokens]
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "wall_s": wall,
        "request_throughput": len(ok) / wall if wall else 0.0,
        "output_throughput": out_tokens / wall if wall else 0.0,
        "output_tokens": out_tokens,
        "goodput": sum(1 for r in ok if good(r)) / wall if wall else 0.0,
        "ttft": stats([r.ttft for r in ok]),
        "tpot": stats([r.tpot for r in ok]),
        "itl": stats([x for r in ok for x in r.itl]),
        "e2e": stats([r.e2e for r in ok]),
        "normalized_latency": stats(normalized),
    }


def median_summary(runs: list[dict]) -> dict:
    """Element-wise median of several summaries (numbers only, nested one level)."""
    out = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = {k: _median([r[key][k] for r in runs]) for k in value}
        elif isinstance(value, (int, float)):
            out[key] = _median([r[key] for r in runs])
        else:
            out[key] = value
    return out


def _median(values):
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None

"""Benchmark tooling: metrics on hand-made timelines, reproducible traces, and a tiny end-to-end run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from benchlib import arrival_times, chat_trace, median_summary, summarize, synthetic_trace  # noqa: E402
from loadgen import Result, percentile  # noqa: E402

from tests.daemon.helpers import Daemon  # noqa: E402


def make(index, ttft, token_times, e2e, tokens):
    return Result(
        index, 0.0, ok=True, ttft=ttft, token_times=token_times, e2e=e2e, output_tokens=tokens, finish_reason="length"
    )


def test_percentiles_interpolate():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10], 95) == 10
    assert percentile([0, 10], 95) == pytest.approx(9.5)
    assert percentile([], 50) is None


def test_tpot_itl_and_goodput_on_a_hand_made_timeline():
    a = make(0, 0.5, [0.6, 0.8, 1.1], 1.1, 4)  # ITL 0.1, 0.2, 0.3; TPOT (1.1 - 0.5) / 3 = 0.2
    b = make(1, 2.0, [2.5], 2.5, 2)  # ITL 0.5; TPOT 0.5
    failed = Result(2, 0.0, ok=False, error="HTTP 429")
    assert a.itl == pytest.approx([0.1, 0.2, 0.3]) and a.tpot == pytest.approx(0.2)
    s = summarize([a, b, failed], wall=5.0, slo_ttft=1.0, slo_tpot=0.25)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["output_throughput"] == pytest.approx(6 / 5) and s["request_throughput"] == pytest.approx(0.4)
    assert s["goodput"] == pytest.approx(1 / 5)  # only a meets both SLOs
    assert s["ttft"]["p50"] == pytest.approx(1.25) and s["ttft"]["mean"] == pytest.approx(1.25)
    assert s["itl"]["p50"] == pytest.approx(0.25)  # of 0.1, 0.2, 0.3, 0.5
    assert s["normalized_latency"]["p50"] == pytest.approx((1.1 / 4 + 2.5 / 2) / 2)
    m = median_summary([s, {**s, "output_throughput": 3.0, "ttft": {**s["ttft"], "p50": 2.0}}, s])
    assert m["output_throughput"] == pytest.approx(6 / 5) and m["ttft"]["p50"] == pytest.approx(1.25)


def test_traces_are_reproducible_from_the_seed():
    corpus = list(range(1000, 3000))
    one = synthetic_trace(20, (10, 50), (5, 40), "poisson:2", 7, corpus)
    two = synthetic_trace(20, (10, 50), (5, 40), "poisson:2", 7, corpus)
    other = synthetic_trace(20, (10, 50), (5, 40), "poisson:2", 8, corpus)
    assert one == two and one != other
    assert all(10 <= len(t.prompt_ids) <= 50 and 5 <= t.max_tokens <= 40 for t in one)
    assert [t.at for t in one] == sorted(t.at for t in one) and one[0].at == 0.0
    assert chat_trace(10, "all", 3) == chat_trace(10, "all", 3)


def test_arrival_processes_have_the_asked_rate():
    times = arrival_times(4000, "poisson:5", 1)
    assert 4000 / times[-1] == pytest.approx(5, rel=0.08)
    bursty = arrival_times(4000, "gamma:5:3", 1)
    gaps = [b - a for a, b in zip(bursty, bursty[1:])]
    mean = sum(gaps) / len(gaps)
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert 1 / mean == pytest.approx(5, rel=0.15) and cv > 2
    assert arrival_times(3, "all", 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="unknown arrival spec"):
        arrival_times(3, "uniform:2", 0)


def test_bench_end_to_end_against_the_tiny_daemon(tiny_chat_model_dir, short_tmp, tmp_path):
    daemon = Daemon(
        short_tmp / "d.sock", tiny_chat_model_dir, "--kv-cache-gb", "0.05", "--max-num-seqs", "4"
    ).wait_ready()
    try:
        out = tmp_path / "bench"
        proc = subprocess.run(
            [
                sys.executable,
                str(SCRIPTS / "bench.py"),
                "--socket",
                str(daemon.socket),
                "--model",  # the daemon shows a model given by path by its folder's name: its tokenizer's path
                str(tiny_chat_model_dir),
                "--requests",
                "6",
                "--prompt-len",
                "8,24",
                "--output-len",
                "4,12",
                "--repeats",
                "1",
                "--warmup",
                "1",
                "--sweep",
                "concurrency:1,3",
                "--natural",  # each answer's length is the model's: the same in both modes
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        variants = {(r["point"], r["variant"]) for r in summary["rows"]}
        assert variants == {("c=1", "continuous"), ("c=1", "static"), ("c=3", "continuous"), ("c=3", "static")}
        for row in summary["rows"]:
            assert row["summary"]["completed"] == 6 and row["summary"]["failed"] == 0
            assert row["same_texts"] == [6, 6]  # each request's text alike in both modes, at both points
        assert "| c=3 | continuous |" in (out / "table.md").read_text()
        assert (out / "throughput_vs_concurrency.png").stat().st_size > 1000
        assert summary["ceilings"]["memory_bandwidth_gb_s"] > 0 and summary["ceilings"]["model_params"] > 0
        # the largest point's step records, both modes: each request's prefill, decodes and (static) padding
        timeline = summary["timeline"]
        assert set(timeline) == {"continuous", "static"} and timeline["static"]["point"] == "c=3"
        for mode, rec in timeline.items():
            rows = [row for s in rec["steps"] for row in s["rows"]]
            states = [row[3] for row in rows]
            # a decode takes one token; a verifying row ("v") its accepted draft tokens too
            decodes = sum(1 + row[5] for row in rows if row[3] in ("d", "v"))
            assert states.count("p") >= 6 and decodes >= 6 * 3 - 6, (mode, states)
            assert all(s["mode"] == mode for s in rec["steps"])
        drawn = subprocess.run(
            [
                sys.executable,
                str(SCRIPTS / "timeline.py"),
                "--json",
                str(out / "summary.json"),
                "--out",
                str(tmp_path / "timeline.png"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert drawn.returncode == 0 and (tmp_path / "timeline.png").stat().st_size > 1000, drawn.stderr[-2000:]
        live = subprocess.run(
            [
                sys.executable,
                str(SCRIPTS / "timeline.py"),
                "--socket",
                str(daemon.socket),
                "--run",
                "--requests",
                "6",
                "--out",
                str(tmp_path / "live.png"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert live.returncode == 0 and (tmp_path / "live.png").stat().st_size > 1000, live.stderr[-2000:]
        both = json.loads((tmp_path / "live.json").read_text())["timeline"]
        assert set(both) == {"continuous", "static"}
        assert any(row[3] == "x" for s in both["static"]["steps"] for row in s["rows"])  # padding shows in static
        assert not any(row[3] == "x" for s in both["continuous"]["steps"] for row in s["rows"])
        fire = subprocess.run(
            [
                sys.executable,
                str(SCRIPTS / "fire.py"),
                "--socket",
                str(daemon.socket),
                "-n",
                "3",
                "--max-tokens",
                "5",
                "--ignore-eos",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines = [line for line in fire.stdout.splitlines() if line.startswith("#")]
        assert (
            fire.returncode == 0
            and "3/3 ok" in fire.stdout
            and len(lines) == 3
            and all("TTFT" in line for line in lines)
        ), fire.stdout
        # the same trace through Anthropic's /v1/messages: every request completes with the same output tokens
        tokens = {}
        for api in ("openai", "messages"):
            run = subprocess.run(
                [sys.executable, str(SCRIPTS / "bench.py"), "--socket", str(daemon.socket), "--api", api]
                + ["--model", str(tiny_chat_model_dir)]
                + ["--requests", "3", "--prompt-len", "8,24", "--output-len", "4,12", "--repeats", "1"]
                + ["--warmup", "0", "--modes", "continuous", "--out", str(tmp_path / api)],
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert run.returncode == 0, run.stderr[-3000:]
            (row,) = json.loads((tmp_path / api / "summary.json").read_text())["rows"]
            assert row["summary"]["completed"] == 3 and row["summary"]["ttft"]["p50"] > 0, row
            tokens[api] = row["summary"]["output_tokens"]
        assert tokens["messages"] == tokens["openai"] > 0
    finally:
        daemon.stop()

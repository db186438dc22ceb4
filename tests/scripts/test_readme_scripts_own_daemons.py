"""The scripts (docs/scripts.md) that start daemons of their own (see test_readme_scripts.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.scripts.helpers import ROOT, SCRIPTS, number, run

pytestmark = pytest.mark.model


def test_bench_embeddings(env, tmp_path):
    """Its own daemon: embeddings alone, then beside a chat; llama.cpp's side only with a llama-server."""
    out = tmp_path / "emb.json"
    # one thread: on a machine whose cores the other tests keep busy, a two-thread daemon waits at every
    # parallel region's barrier for a preempted thread (four times as long here)
    args = [
        "--inputs",
        "6",
        "--clients",
        "3",
        "--chats",
        "1",
        "--chat-seconds",
        "2",
        "--chat-tokens",
        "6",
        "--threads",
        "1",
    ]
    env = {k: v for k, v in env.items() if k != "LLAMA_SERVER"}
    proc = run(env, SCRIPTS / "features" / "bench_embeddings.py", *args, "--json", out, timeout=600)
    mb = json.loads(out.read_text())["minibatch"]
    for side in ("alone", "beside_chats"):
        assert mb[side]["inputs"] == 6 and mb[side]["inputs_s"] > 0 and mb[side]["tokens_s"] > 0
    assert mb["chat_tpot_ms_alone"] > 0 and mb["chat_tpot_ms_beside"] > 0 and min(mb["chat_answers"]) >= 1
    assert "| minibatch | beside 1 chats |" in proc.stdout


def test_bench_cluster(env, tmp_path):
    """The daemon and the prefix-routed cluster. The least-loaded setup is not run here (a third start of Ray,
    40 s of CI): it differs from the prefix one only in the ingress attaching no prefix hashes to a request
    (daemon/cluster/ingress.py), the router's path for every request without a prompt, which the cluster
    tests' engine views and health checks take."""
    pytest.importorskip("ray", reason="the cluster extra is not installed")
    out = tmp_path / "cluster.json"
    args = ["--conversations", "3", "--concurrency", "2", "--max-tokens", "6", "--latency-requests", "5",
            "--threads", "1", "--setups", "daemon,prefix"]  # fmt: skip
    proc = run(env, SCRIPTS / "features" / "bench_cluster.py", *args, "--out", out, timeout=600)
    report = json.loads(out.read_text())
    setups = {r["setup"]: r for r in report["setups"]}
    assert set(setups) == {"daemon", "prefix"}
    for name, r in setups.items():  # every setup replayed every turn of the same conversations
        assert r["turns"] == setups["daemon"]["turns"] >= 9 and r["output_tok_s"] > 0, name
        assert 0 < r["prefix_hit_rate"] < 1  # later turns reuse earlier turns' blocks
        assert re.search(rf"^\| {name} \| {r['turns']} \| [\d.]+ \| \d+ / \d+ \| [\d.]+% \|$", proc.stdout, re.M)
    assert setups["prefix"]["route_decisions"]["hit"] >= setups["daemon"]["turns"] - 3  # every later turn
    one = setups["prefix"]["one_token"]
    assert one["ingress_p50_ms"] > 0 and one["direct_p50_ms"] > 0
    added = re.search(r"the ingress adds (-?[\d.]+) ms \(p50\), (-?[\d.]+) ms \(p99\)", proc.stdout)
    assert float(added[1]) == pytest.approx(one["added_p50_ms"], abs=0.06)
    assert float(added[2]) == pytest.approx(one["added_p99_ms"], abs=0.06)
    assert number(r"prefix: the ingress process used [\d.]+ CPU s, ([\d.]+) us per streamed token", proc.stdout) > 0
    assert number(r"([\d.]+) µs to hash its text blocks", proc.stdout) > 0
    assert number(r"([\d.]+) µs to render its chat template and tokenize", proc.stdout) > 0


def test_fuzz_script(env):
    # The deep run with 2 examples per operation and mode, for the chat operations (the whole check runs in
    # tests/reliability/test_fuzz.py): check 17 from its own shell script, its pytest arguments passed on.
    proc = subprocess.run(
        ["bash", str(SCRIPTS / "fuzz.sh"), "2", "-k", "chat", "-vv"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**env, "PYTHON": sys.executable},
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fuzz: 2 examples per operation and mode" in proc.stdout
    ran = re.findall(r"test_check17_fuzz_every_operation\[(\S+ \S+)-(socket|tcp)\] PASSED", proc.stdout)
    assert len(ran) >= 4 and all("chat" in op for op, _ in ran), proc.stdout[-3000:]
    assert {listener for _, listener in ran} == {"socket", "tcp"}


def test_record_quick(env, tmp_path):
    """`make bench`'s pieces with the smallest parameters: a private daemon per model, both modes at two
    points, the prefill; then published into a copy of the docs. (The sweeps piece is bench.py's --sweep over
    other axes, which test_bench.py runs; here it took a minute of CI.)"""
    docs = tmp_path / "docs"
    (docs / "docs" / "bench").mkdir(parents=True)
    for name in ("README.md", "BENCHMARKS.md"):
        shutil.copy(ROOT / name, docs / name)
    args = ["--quick", "--models", "smollm2-135m-instruct", "--pieces", "serving,modes,prefill"]
    args += [
        "--concurrency",
        "1,2",
        "--requests",
        "2",
        "--repeats",
        "1",
        "--prefill-tokens",
        "32",
        "--output-len",
        "8,32",
    ]
    proc = run(env, SCRIPTS / "record.py", *args, "--out", tmp_path / "out", "--publish", "--docs", docs, timeout=900)
    [path] = (tmp_path / "out").glob("*/record.json")
    record = json.loads(path.read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert record["run"]["commit"] == head[:12] and record["run"]["quick"] is True
    assert record["run"]["machine"]["cores"] == os.cpu_count() and record["run"]["versions"]["torch"]
    secs = record["sections"]
    assert set(secs) == {"serving", "modes", "prefill"}
    assert "outputs of 8-32 forced" in secs["modes"]["trace"]
    [model] = secs["modes"]["models"]
    assert [p["c"] for p in model["points"]] == [1, 2]
    for p in model["points"]:
        for mode in ("continuous", "static"):
            m = p[mode]
            assert m["failed"] == 0 and m["requests"] == 2 and m["tok_s"] > 0 and m["ttft"]["p50"] > 0, (p, mode)
            assert m["e2e"]["p50"] <= m["e2e"]["p95"] <= m["e2e"]["p99"]
        assert p["continuous"]["wasted_row_steps"] == 0 and p["static"]["wasted_row_steps"] >= 0
    [serving] = secs["serving"]["rows"]
    assert serving["start_s"] > 0 and serving["rss_after_mb"] > 100 and serving["file_mb"] > 90
    [pre] = secs["prefill"]["rows"]
    assert pre["tokens"] == 32 and pre["tok_s"] == pytest.approx(32 / pre["step_ms"] * 1e3)
    assert "peers" not in secs and any("record: plot:" in line for line in proc.stderr.splitlines())
    # published: the copy's record holds the run's sections, its tables were rewritten from them
    published = json.loads((docs / "docs" / "bench" / "record.json").read_text())
    assert published["sections"] == secs
    readme = (docs / "README.md").read_text()
    block = readme[readme.index("<!-- record:modes-headline -->") : readme.index("<!-- /record:modes-headline -->")]
    assert "`make bench --quick`" in block and head[:10] in block
    rows = re.findall(r"^\| (\d+) \| \**([\d.]+)\** / \**([\d.]+)\** \| ([\d.]+)×", block, re.M)
    assert [int(r[0]) for r in rows] == [1, 2]
    for (_, cont, stat, ratio), p in zip(rows, model["points"]):
        assert float(cont) == pytest.approx(p["continuous"]["tok_s"], abs=0.05)
        assert float(stat) == pytest.approx(p["static"]["tok_s"], abs=0.05)
        assert float(ratio) == pytest.approx(p["continuous"]["tok_s"] / p["static"]["tok_s"], abs=0.006)
    assert (docs / "docs" / "bench" / "record_modes.png").stat().st_size > 0


def test_bench_long_context(env, tmp_path):
    """Its own daemons, one per KV cache type, over the built-in model; llama.cpp's side only with a llama-server."""
    out = tmp_path / "long.json"
    env = {k: v for k, v in env.items() if k != "LLAMA_SERVER"}
    args = ["--lengths", "64,300", "--types", "q8_0,f32", "--max-tokens", "6", "--threads", "1", "--json", out]
    proc = run(env, SCRIPTS / "features" / "bench_long_context.py", *args, timeout=600)
    results = json.loads(out.read_text())
    assert [r["server"] for r in results] == ["minibatchd q8_0", "minibatchd f32"], proc.stdout
    for r in results:
        assert [row["length"] for row in r["rows"]] == [64, 300] and r["rss_mb"] > 0
        assert all(row["prefill"] > 0 and row["decode"] > 0 for row in r["rows"])
        assert abs(r["rows"][1]["prompt_tokens"] - 300) <= 2  # the prompt is the length asked
    assert "| minibatchd q8_0 |" in proc.stdout


def test_bench_agent(env, tmp_path):
    """Its own daemons, the disk tier off and on, over the built-in model: a restart keeps the prefix only with it."""
    out = tmp_path / "agent.json"
    env = {k: v for k, v in env.items() if k != "LLAMA_SERVER"}
    args = ["--system-tokens", "300", "--turns", "4", "--restart-after", "1", "--unload-after", "2", "--max-tokens",
            "4", "--threads", "1", "--cold-prompts", "1", "--cold-tokens", "64", "--json", out]  # fmt: skip
    proc = run(env, SCRIPTS / "features" / "bench_agent.py", *args, timeout=600)
    results = {r["server"]: r for r in json.loads(out.read_text())["results"]}
    off, on = results["minibatchd disk tier off"], results["minibatchd disk tier on"]
    assert [t["event"] for t in on["turns"]] == ["", "restarted", "unloaded", ""]
    assert off["turns"][1]["cached"] == off["turns"][2]["cached"] == 0  # nothing kept without the tier
    assert on["turns"][1]["cached"] >= 288 and on["turns"][2]["cached"] >= 288  # the restart and the unload
    assert on["turns"][3]["cached"] > on["turns"][2]["cached"]  # the conversation's own growth, from memory
    assert on["disk"]["disk_hit_blocks"] > 0 and not off["disk"]["disk_cache"]
    assert len(on["cold_ttft"]) == 1 and on["cold_ttft"][0] > 0
    assert "first turn after the restart" in proc.stdout and "| 2 (restarted) |" in proc.stdout
    # in-process: the read-or-recompute crossover, and the tier's cost with nothing to hit
    cross = tmp_path / "cross.json"
    args = ["--crossover", "1,2", "--busy", "1", "--repeats", "1", "--threads", "1", "--json", cross]
    proc = run(env, SCRIPTS / "features" / "bench_agent.py", *args, timeout=600)
    rows = json.loads(cross.read_text())
    assert {(r["k"], r["busy"], r["tier"]) for r in rows} == {(k, b, t) for k in (1, 2) for b in (0, 1) for t in (0, 1)}
    assert all(r["disk_tokens"] == 16 * r["k"] for r in rows if r["tier"])  # read back, every block
    assert all(r["disk_tokens"] == 0 for r in rows if not r["tier"]) and "| 2 | 1 |" in proc.stdout
    ab = tmp_path / "ab.json"
    proc = run(
        env,
        SCRIPTS / "features" / "bench_agent.py",
        "--overhead",
        "2",
        "--cold-tokens",
        "48",
        "--threads",
        "1",
        "--json",
        ab,
    )
    assert len(json.loads(ab.read_text())) == 2 and "median of 2 pairs" in proc.stdout


def test_bench_infill(env, tmp_path, tiny_chat_model_dir):
    """Its own daemons over a tiny model with fill-in-the-middle markers: reuse on holds more of each prompt than
    off, the burst is measured; in-process, the agreement of reused answers with computed ones."""
    from tests.daemon.helpers import with_fim_markers

    model = with_fim_markers(tiny_chat_model_dir, tmp_path / "fim")
    out = tmp_path / "infill.json"
    env = {k: v for k, v in env.items() if k != "LLAMA_SERVER"}
    args = ["--gguf", model, "--editors", "1,2", "--sites", "2", "--words", "3", "--burst", "3", "--burst-places", "1",
            "--n-predict", "2", "--threads", "1", "--variants", "reuse,noreuse", "--cache-reuse", "32", "--ctx", "1024",
            "--pause", "0", "--json", out]  # fmt: skip
    proc = run(env, SCRIPTS / "features" / "bench_infill.py", *args, timeout=600)
    results = {(r["variant"], r["editors"]): r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {("reuse", 1), ("noreuse", 1), ("reuse", 2)}
    on, off = results[("reuse", 1)], results[("noreuse", 1)]
    assert on["requests"] == off["requests"] == 5 and results[("reuse", 2)]["requests"] == 10
    assert all(r["ttft"] > 0 and r["total"] >= r["ttft"] for r in on["rows"] + off["rows"])
    assert on["prompt_tokens"] == off["prompt_tokens"] and on["cached"] > off["cached"]
    assert len(on["lone_ttft"]) == len(on["burst_last_ttft"]) == 1
    assert "| minibatchd --cache-reuse 32 | 1 | 5 |" in proc.stdout
    agree = tmp_path / "agree.json"
    args = ["--agreement", "32", "--sites", "2", "--words", "2", "--n-predict", "2", "--ctx", "1024", "--json", agree]
    run(env, SCRIPTS / "features" / "bench_infill.py", *args, timeout=600)
    rows = {r["variant"]: r for r in json.loads(agree.read_text())["agreement"]}
    assert set(rows) == {"f16 cache", "ngram speculation", "--cache-reuse 32", "--cache-reuse 32, settle 0"}
    assert rows["f16 cache"]["reused_tokens"] == 0 and rows["ngram speculation"]["same_suggestion"] == 1
    assert rows["--cache-reuse 32"]["reused_tokens"] > 0 and 0 <= rows["--cache-reuse 32"]["same_first_token"] <= 1

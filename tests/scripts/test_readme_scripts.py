"""Every script in the table of docs/scripts.md, run as a new user runs it: the built-in model, default
weights, and a model cache that starts empty (so nothing a machine converted earlier can hide a gap).

Each runs end to end with the smallest parameters that take it through its whole path, and its output
is checked for the figures it promises. The scripts are in three modules, so that workers run them side by
side: here the daemon-facing ones, which share one real minibatchd on its Unix socket and on its TCP listener
(`bench.py --url`); in test_readme_scripts_in_process.py those that build their engine in their own process;
in test_readme_scripts_own_daemons.py those that start daemons of their own.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from minibatch.daemon.client import request_json
from tests.daemon.helpers import Daemon
from tests.scripts.helpers import ROOT, SCRIPTS, marked, number, run

pytestmark = pytest.mark.model

# The scripts table (docs/scripts.md), script by script, and the module and test that run it.
COVERED = {
    "fire.py": "test_fire",
    "features/bench_chat.py": "test_bench_chat",
    "features/bench_spec.py": "test_bench_spec",
    "features/bench_models.py": "test_bench_models",
    "bench.py": "test_bench_over_the_socket",
    "kernels/bench_engine.py": "in_process:test_bench_engine_quick",
    "kernels/bench_sampling.py": "in_process:test_bench_sampling",
    "features/bench_embeddings.py": "own_daemons:test_bench_embeddings",
    "features/bench_overhead.py": "in_process:test_bench_overhead",
    "features/bench_cluster.py": "own_daemons:test_bench_cluster",
    "soak.py": "test_soak",
    "kernels/bench_driver.py": "in_process:test_bench_driver",
    "timeline.py": "test_timeline_run",
    "kernels/profile_step.py": "in_process:test_profile_step",
    "kernels/bench_grammar.py": "in_process:test_bench_grammar",
    "kernels/bench_decode_attention.py": "in_process:test_bench_decode_attention",
    "kernels/bench_long_attention.py": "in_process:test_bench_long_attention",
    "features/bench_long_context.py": "own_daemons:test_bench_long_context",
    "features/bench_agent.py": "own_daemons:test_bench_agent",
    "features/bench_infill.py": "own_daemons:test_bench_infill",
    "kernels/bench_quant_matmul.py": "in_process:test_bench_quant_matmul",
    "kernels/roofline.py": "in_process:test_roofline",
    "dev/make_model.py": "in_process:test_make_model",
    "dev/make_encoder.py": "retrieval:test_make_encoder",
    "features/bench_retrieval.py": "retrieval:test_bench_retrieval",
    "features/bench_lora.py": "lora:test_bench_lora",
    "dev/make_vision_model.py": "vision:test_make_vision_model",
    "features/bench_vision.py": "vision:test_bench_vision",
    "kernels/perplexity.py": "in_process:test_perplexity",
    "fuzz.sh": "own_daemons:test_fuzz_script",
    "record.py": "own_daemons:test_record_quick",
    "tables.py": "test_tables_check",
    "screenshot.py": "test_screenshot",
}


def test_every_script_in_the_scripts_table_has_a_test_here():
    table = marked(ROOT / "docs" / "scripts.md", "scripts")
    listed = set(re.findall(r"^\| `scripts/((?:[a-z_]+/)?[a-z_]+\.(?:py|sh))`", table, re.M))
    assert listed == set(COVERED), listed ^ set(COVERED)
    for where in COVERED.values():
        module, _, name = where.rpartition(":")
        here = f"{__package__}.test_readme_scripts_{module}" if module else __name__
        tests = importlib.import_module(here)
        assert callable(getattr(tests, name, None)), f"{where}: no such test"


@pytest.fixture(scope="module")
def models_folder(fresh_cache) -> Path:
    """The shared daemon's models folder: a model a test makes is served from here by its name."""
    folder = fresh_cache / "models-folder"
    folder.mkdir()
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def daemon(env, fresh_cache, models_folder):
    """minibatchd with the built-in model and its default weights, converted into the empty cache."""
    d = Path(tempfile.mkdtemp(prefix="mb-", dir="/tmp"))
    port = free_port()
    daemon = Daemon(
        d / "d.sock",
        "smollm2-135m-instruct",
        "--port",
        str(port),
        "--max-num-seqs",
        "8",
        "--kv-cache-gb",
        "0.25",
        env={"MINIBATCH_CACHE_DIR": str(fresh_cache), "MINIBATCH_MODELS_DIR": str(models_folder)},
    ).wait_ready()
    daemon.url = f"http://127.0.0.1:{port}"
    try:
        yield daemon
    finally:
        assert daemon.stop() == 0, daemon.log_text()
        shutil.rmtree(d, ignore_errors=True)


def test_the_daemon_publishes_its_weights(daemon):
    _, health = daemon.get("/health")
    memory = health["memory"]
    assert "model_dir" not in health  # no server path in an answer
    from minibatch.engine.store.cache import resolve_model

    cached = resolve_model(health["model"])  # config and tokenizer only: the weights are read from the GGUF itself
    assert (cached / "config.json").is_file() and not list(cached.glob("*.safetensors"))
    # SmolLM2-135M: 134.5M distinct parameters (tied output projection counted once), read from 4-bit blocks
    assert 134e6 < memory["num_params"] < 136e6
    groups = {g["name"]: g for g in memory["groups"]}
    assert set(groups) == {"embedding", "attention", "mlp", "output", "norms"}
    assert set(groups["mlp"]["types"]) == {"Q4_1"} and set(groups["embedding"]["types"]) == {"Q8_0"}
    # a Q4_1 block holds 32 values in 20 bytes; the tied output projection streams the embedding's Q8_0 blocks
    assert groups["mlp"]["bytes"] == groups["mlp"]["params"] * 20 // 32
    assert memory["matmul_bytes_per_step"] == sum(groups[g]["bytes"] for g in ("attention", "mlp", "output"))
    assert memory["loaded_bytes"] == sum(groups[g]["bytes"] for g in ("embedding", "attention", "mlp", "norms"))
    assert memory["loaded_bytes"] < 100e6  # one copy of the 98 MB file's blocks


def test_bench_over_the_socket(daemon, env, tmp_path):
    out = tmp_path / "bench"
    proc = run(
        env,
        SCRIPTS / "bench.py",
        "--socket",
        daemon.socket,
        "--requests",
        "4",
        "--prompt-len",
        "8,16",
        "--output-len",
        "4,8",
        "--repeats",
        "1",
        "--warmup",
        "1",
        "--sweep",
        "concurrency:1,2",
        "--out",
        out,
    )
    summary = json.loads((out / "summary.json").read_text())
    assert {(r["point"], r["variant"]) for r in summary["rows"]} == {
        (p, m) for p in ("c=1", "c=2") for m in ("continuous", "static")
    }
    assert all(r["summary"]["completed"] == 4 and r["summary"]["failed"] == 0 for r in summary["rows"])
    assert all(r["same_texts"] == [4, 4] for r in summary["rows"])  # the same answers in both modes
    c = summary["ceilings"]
    memory = summary["daemon"]["memory"]
    assert c["model_params"] == memory["num_params"] and c["matmul_bytes_per_step"] == memory["matmul_bytes_per_step"]
    assert c["batch1_bandwidth_bound_tok_s"] == pytest.approx(
        c["memory_read_gb_s"] * 1e9 / memory["matmul_bytes_per_step"]
    )
    bound = number(r"batch-1 read-bandwidth bound ([\d.]+) tok/s", proc.stdout)
    assert bound == pytest.approx(c["batch1_bandwidth_bound_tok_s"], abs=0.06)
    assert "| c=2 | continuous |" in (out / "table.md").read_text()
    for plot in ("throughput_vs_concurrency.png", "ttft_cdf.png"):
        assert (out / plot).stat().st_size > 1000 and f"plot: {out / plot}" in proc.stdout


def test_bench_over_tcp(daemon, env, tmp_path):
    out = tmp_path / "bench-url"
    proc = run(
        env,
        SCRIPTS / "bench.py",
        "--url",
        daemon.url,
        "--model",
        "smollm2-135m-instruct",
        "--requests",
        "3",
        "--prompt-len",
        "8,16",
        "--output-len",
        "4,8",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--sampling",
        "ollama",
        "--out",
        out,
    )
    summary = json.loads((out / "summary.json").read_text())
    (row,) = summary["rows"]
    assert row["variant"] == "server" and row["summary"]["completed"] == 3 and row["summary"]["output_tokens"] >= 12
    assert summary["args"]["sampling"] == "ollama"
    assert summary["ceilings"]["batch1_bandwidth_bound_tok_s"] > 0  # the daemon says what its weights are over TCP too
    assert "| main | server |" in proc.stdout


def test_fire(daemon, env):
    proc = run(env, SCRIPTS / "fire.py", "--socket", daemon.socket, "-n", "3", "--max-tokens", "6", "--ignore-eos")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("#")]
    assert len(lines) == 3 and all("TTFT" in line and "6 tok" in line for line in lines), proc.stdout
    assert "3/3 ok" in proc.stdout and number(r"([\d.]+) tok/s overall", proc.stdout) > 0


def test_bench_chat(daemon, env, tmp_path):
    """The real chat in a pseudo-terminal, two panes broadcasting, against the same requests without it."""
    report = tmp_path / "chat.json"
    args = ["--socket", daemon.socket, "--panes", "2", "--max-tokens", "12", "--repeats", "1", "--hog", "0.5"]
    proc = run(env, SCRIPTS / "features" / "bench_chat.py", *args, "--size", "120x36", "--json", report)
    (row,) = json.loads(report.read_text())["rows"]
    with_chat, without = row["with"], row["without"]
    # the chat's sampling defaults, seeded: the chat's requests and the plain client's draw the same tokens
    assert json.loads(report.read_text())["sampling"] == {
        "temperature": 0.7,
        "top_p": 0.95,
        "max_tokens": 12,
        "seed": 1,
    }
    assert with_chat["tokens"] == without["tokens"] and 2 <= without["tokens"] <= 24
    assert with_chat["chat_cpu_s"] > 0 and with_chat["frames_per_s"] > 0 and with_chat["chat_rss_mb"] > 10
    # one repeat: its pair's ratio is the median, the hog's ratio is against that repeat's idle run
    assert row["ratios"] == [pytest.approx(with_chat["tok_s"] / without["tok_s"])] and row["ratio"] == row["ratios"][0]
    hogged = row["hog"]["0.5"]
    assert hogged["tokens"] == without["tokens"]
    assert hogged["ratios"] == [pytest.approx(hogged["tok_s"] / without["tok_s"])]
    assert hogged["ratio"] == hogged["ratios"][0]
    # the engine's own window starts when the first request arrives: after the key, before the last token
    for v in (with_chat, without):
        assert 0 <= v["dispatch_s"] < v["wall_s"] and v["engine_tok_s"] >= v["tok_s"]
    assert row["engine_ratio"] == pytest.approx(with_chat["engine_tok_s"] / without["engine_tok_s"])
    assert "2 panes: engine" in proc.stdout and "beside a busy loop of 50% of a core" in proc.stdout
    assert "the broadcast reached the engine" in proc.stdout


def test_bench_models(daemon, env, tmp_path, models_folder):
    """Two models through one daemon: their loads, the memory an unload returns, each alone and both at once."""
    # two made models in its models folder, named by requests as m1 and m2: the daemon's own model stays as
    # the other tests find it (warm caches included)
    made = [models_folder / f"m{seed}.gguf" for seed in (1, 2)]
    for seed, path in zip((1, 2), made):
        shape = ["--shape", "smollm2-135m", "--layers", "2", "--quantize", "Q4_1", "--seed", str(seed)]
        run(env, SCRIPTS / "dev" / "make_model.py", *shape, "--out", path)
    report = tmp_path / "models.json"
    args = ["--socket", daemon.socket, "--models", "m1,m2", "--concurrency", "1"]
    proc = run(
        env,
        SCRIPTS / "features" / "bench_models.py",
        *args,
        "--requests",
        "2",
        "--repeats",
        "1",
        "--max-tokens",
        "4",
        "--json",
        report,
    )
    (entry,) = json.loads(report.read_text())["loops"].values()
    for load in entry["loads"]:
        for kind in ("first", "reload"):
            r = load[kind]
            assert r["load_s"] > 0 and r["rss_loaded_mb"] > r["rss_after_unload_mb"] > 0
    rows = {(r["scenario"], r["model"]): r for r in entry["busy"]}
    a, b = "m1", "m2"
    assert set(rows) == {("alone", a), ("alone", b), ("together", a), ("together", b), ("together", f"{a}+{b}")}
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
    assert all(r["failed"] == 0 for r in rows.values() if "failed" in r)
    assert f"| together | {a} |" in proc.stdout
    for name in (a, b):  # unloaded again: the shared daemon keeps only what it had
        status, out = request_json(str(daemon.socket), "POST", "/api/generate", {"model": name, "keep_alive": 0})
        assert status == 200 and out["done_reason"] == "unload", out
    _, health = daemon.get("/health")
    assert health["model"] == "smollm2-135m-instruct" and "memory" in health  # left as it was found


def test_bench_spec(daemon, env, tmp_path):
    """Speculation on and off through one daemon: the same greedy texts, drafts only where it is on."""
    report = tmp_path / "spec.json"
    args = ["--socket", daemon.socket, "--workloads", "copy,forced", "--concurrency", "1", "--repeats", "1"]
    proc = run(env, SCRIPTS / "features" / "bench_spec.py", *args, "--max-tokens", "16", "--json", report)
    rows = json.loads(report.read_text())
    assert [(r["workload"], r["variant"]) for r in rows] == [
        ("copy", "off"),
        ("copy", "ngram"),
        ("forced", "off"),
        ("forced", "ngram"),
    ]
    assert all(r["same_text_as_off"] and r["failed"] == 0 and r["tokens_per_s"] > 0 for r in rows)
    assert all(r["draft_tokens"] == 0 for r in rows if r["variant"] == "off")
    on = [r for r in rows if r["variant"] == "ngram"]
    assert all(r["accepted_tokens"] <= r["draft_tokens"] for r in on) and sum(r["draft_tokens"] for r in on) > 0
    assert "| copy | 1 | ngram |" in proc.stdout


def test_timeline_run(daemon, env, tmp_path):
    png = tmp_path / "timeline.png"
    run(env, SCRIPTS / "timeline.py", "--socket", daemon.socket, "--run", "--requests", "4", "--out", png)
    assert png.stat().st_size > 1000
    both = json.loads(png.with_suffix(".json").read_text())["timeline"]
    assert set(both) == {"continuous", "static"} and all(both[m]["steps"] for m in both)


def test_soak(daemon, env):
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "soak.py"),
            "--socket",
            str(daemon.socket),
            "--minutes",
            "0.1",
            "--window",
            "2",
            "--rate",
            "4",
            "--max-tokens",
            "6",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    windows = [line for line in proc.stdout.splitlines() if line.startswith("2s ")]
    assert len(windows) >= 2 and all("RSS" in w and "fds" in w and "p99 TTFT" in w for w in windows), proc.stdout
    verdict = dict(re.findall(r"^  (PASS|FAIL)  (.+)$", proc.stdout, re.M)[i][::-1] for i in range(5))
    # a few seconds cannot judge RSS growth or TTFT drift; what must hold at any length:
    assert verdict["KV back to idle baseline"] == "PASS" and verdict["no failed requests"] == "PASS", proc.stdout
    assert proc.returncode == (0 if set(verdict.values()) == {"PASS"} else 1)


def test_tables_check(env):
    """The committed tables are what the committed record renders (scripts/tables.py's round trip)."""
    proc = run(env, SCRIPTS / "tables.py", "--check")
    assert proc.stdout == ""
    edited = Path(tempfile.mkdtemp(prefix="mb-tables-"))
    try:
        shutil.copytree(ROOT / "docs", edited / "docs")
        readme = (ROOT / "README.md").read_text()
        shutil.copy(ROOT / "BENCHMARKS.md", edited / "BENCHMARKS.md")
        start = readme.index("<!-- record:modes-headline -->")
        cut = readme.index("| 1 |", start)
        (edited / "README.md").write_text(readme[:cut] + "| 1 | 999 |" + readme[cut + 5 :])
        proc = subprocess.run(
            [sys.executable, str(SCRIPTS / "tables.py"), "--check", "--root", str(edited)],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 1 and "README.md: differs from the record: modes-headline" in proc.stdout
        run(env, SCRIPTS / "tables.py", "--root", edited)
        assert (edited / "README.md").read_text() == readme
    finally:
        shutil.rmtree(edited, ignore_errors=True)


def test_screenshot(daemon, env, tmp_path):
    """The README's picture from the real chat against the shared daemon: four panes, the panel, the block map."""
    out = tmp_path / "chat.svg"
    args = ["--socket", daemon.socket, "--out", out, "--chunks", "2", "--seconds", "30"]
    proc = run(env, SCRIPTS / "screenshot.py", *args, "--prompt", "Say hi.", timeout=300)
    assert f"screenshot: {out}" in proc.stdout
    svg = out.read_text()
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    text = re.sub(r"&#160;|\\s+", " ", re.sub(r"<[^>]+>", "", svg))
    for pane in range(1, 5):  # every pane asked, beside the panel
        assert f"pane {pane}" in text, text[:2000]
    assert "continuous" in text and "KV" in text, text[:2000]

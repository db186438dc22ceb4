"""Every script in the README's Scripts table, run as a new user runs it: the built-in model, default
weights, and a model cache that starts empty (so nothing a machine converted earlier can hide a gap).

Each runs end to end with the smallest parameters that take it through its whole path, and its output
is checked for the figures it promises. The daemon-facing scripts share one real minibatchd, on its
Unix socket and on its TCP listener (`bench.py --url`).
"""

from __future__ import annotations

import json
import os
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

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
pytestmark = pytest.mark.model

# The README's table, script by script, and the test below that runs it.
COVERED = {
    "fire.py": "test_fire",
    "bench_chat.py": "test_bench_chat",
    "bench_spec.py": "test_bench_spec",
    "bench_models.py": "test_bench_models",
    "bench.py": "test_bench_over_the_socket",
    "bench_engine.py": "test_bench_engine_quick",
    "bench_sampling.py": "test_bench_sampling",
    "bench_embeddings.py": "test_bench_embeddings",
    "bench_overhead.py": "test_bench_overhead",
    "bench_cluster.py": "test_bench_cluster",
    "soak.py": "test_soak",
    "bench_driver.py": "test_bench_driver",
    "timeline.py": "test_timeline_run",
    "profile_step.py": "test_profile_step",
    "bench_grammar.py": "test_bench_grammar",
    "bench_decode_attention.py": "test_bench_decode_attention",
    "bench_quant_matmul.py": "test_bench_quant_matmul",
    "make_model.py": "test_make_model",
    "perplexity.py": "test_perplexity",
    "fuzz.sh": "test_fuzz_script",
    "record.py": "test_record_quick",
    "tables.py": "test_tables_check",
}


@pytest.fixture(scope="module")
def fresh_cache():
    d = tempfile.mkdtemp(prefix="mb-cache-")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def env(fresh_cache) -> dict:
    return {**os.environ, "MINIBATCH_CACHE_DIR": str(fresh_cache)}


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


def run(env, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, f"{args}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def number(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in:\n{text[-3000:]}"
    return float(m.group(1))


def marked(path: Path, name: str) -> str:
    """The text between `<!-- NAME -->` and `<!-- /NAME -->` in a document (found by marker, not by position)."""
    text = path.read_text()
    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    assert start in text and end in text, f"{path.name} lacks the markers {start} ... {end} that this test reads"
    return text[text.index(start) + len(start) : text.index(end)]


def test_every_script_in_the_readme_table_has_a_test_here():
    table = marked(ROOT / "README.md", "scripts")
    listed = set(re.findall(r"^\| `scripts/([a-z_]+\.(?:py|sh))`", table, re.M))
    assert listed == set(COVERED), listed ^ set(COVERED)
    assert all(name in globals() for name in COVERED.values())


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
    proc = run(env, SCRIPTS / "bench_chat.py", *args, "--size", "120x36", "--json", report)
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
        run(env, SCRIPTS / "make_model.py", *shape, "--out", path)
    report = tmp_path / "models.json"
    args = ["--socket", daemon.socket, "--models", "m1,m2", "--concurrency", "1"]
    proc = run(
        env,
        SCRIPTS / "bench_models.py",
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
    proc = run(env, SCRIPTS / "bench_spec.py", *args, "--max-tokens", "16", "--json", report)
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


def test_bench_spec_in_process(env, tmp_path):
    """The two in-process measurements: a forward's time by rows and draft length, and tok/s by K and n."""
    cost, sweep = tmp_path / "cost.json", tmp_path / "sweep.json"
    run(env, SCRIPTS / "bench_spec.py", "--in-process", "verify-cost", "--repeats", "1", "--json", cost)
    rows = json.loads(cost.read_text())
    assert [r["rows"] for r in rows] == [1, 4, 16] and all(r["k0_ms"] > 0 and r["k8_ms"] > 0 for r in rows)
    args = ["--in-process", "draft-sweep", "--workloads", "copy", "--max-tokens", "4", "--repeats", "1"]
    run(env, SCRIPTS / "bench_spec.py", *args, "--json", sweep)
    out = json.loads(sweep.read_text())
    assert out[0]["config"] == "off" and out[0]["x_off"] == 1.0 and len(out) == 7 and all(r["tok_s"] > 0 for r in out)


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


def test_bench_engine_quick(env, tmp_path):
    out = tmp_path / "engine.json"
    proc = run(
        env,
        SCRIPTS / "bench_engine.py",
        "--quick",
        "--requests",
        "4",
        "--repeats",
        "1",
        "--hf-repeats",
        "1",
        "--json",
        out,
        timeout=600,
    )
    data = json.loads(out.read_text())
    assert set(data["median"]) == {"continuous", "static", "hf-static", "hf-cb"} and not data["errors"]
    eff = data["efficiency"]
    assert 0 < eff["efficiency"] <= 1.5 and eff["matmuls"] == 4 * 30 + 1 and "Q4_1" in eff["weights"]
    assert 90e6 < eff["matmul_bytes_per_step"] < 100e6  # 4-bit layers and the Q8_0 output projection, as stored
    assert number(r"batch-1 decode: minibatch ([\d.]+) tok/s", proc.stdout) > 0
    assert "engine efficiency at 16 running" in proc.stdout


def test_bench_sampling(env, tmp_path):
    out = tmp_path / "sampling.json"
    proc = run(
        env,
        SCRIPTS / "bench_sampling.py",
        *("--calls", "1", "--concurrency", "2", "--tokens", "4", "--repeats", "1", "--spec", "off", "--json", out),
        timeout=600,
    )
    data = json.loads(out.read_text())
    shapes = {r["logits"] for r in data["sampler"]}
    settings = {r["setting"] for r in data["sampler"]}
    assert {"chat + typical_p 0.9", "chat + DRY 0.8", "Mirostat 2 (tau 5, eta 0.1)"} <= settings  # beside the fused
    assert len(shapes) == 3 and len(data["sampler"]) == 3 * len(settings) * 2
    assert all(r["ms_per_row"] > 0 for r in data["sampler"])
    (row,) = data["engine"]
    assert row["concurrency"] == 2 and all(row[w] > 0 for w in ("greedy", "chat", "ollama"))
    assert number(r"spec off\s+c= 2: greedy ([\d.]+) tok/s", proc.stdout) == pytest.approx(row["greedy"], rel=0.01)


def test_bench_overhead(env):
    proc = run(env, SCRIPTS / "bench_overhead.py", "--requests", "3", "--repeats", "1")
    inproc = number(r"in-process: ([\d.]+) output tok/s", proc.stdout)
    socket_side = number(r"through the socket \(3 concurrent SSE streams\): ([\d.]+) output tok/s", proc.stdout)
    assert number(r"socket / in-process: ([\d.]+)", proc.stdout) == pytest.approx(socket_side / inproc, abs=0.002)


def test_bench_embeddings(env, tmp_path):
    """Its own daemon: embeddings alone, then beside a chat; llama.cpp's side only with a llama-server."""
    out = tmp_path / "emb.json"
    args = ["--inputs", "6", "--clients", "3", "--chats", "1", "--chat-seconds", "2", "--chat-tokens", "6"]
    env = {k: v for k, v in env.items() if k != "LLAMA_SERVER"}
    proc = run(env, SCRIPTS / "bench_embeddings.py", *args, "--json", out, timeout=600)
    mb = json.loads(out.read_text())["minibatch"]
    for side in ("alone", "beside_chats"):
        assert mb[side]["inputs"] == 6 and mb[side]["inputs_s"] > 0 and mb[side]["tokens_s"] > 0
    assert mb["chat_tpot_ms_alone"] > 0 and mb["chat_tpot_ms_beside"] > 0 and min(mb["chat_answers"]) >= 1
    assert "| minibatch | beside 1 chats |" in proc.stdout


def test_bench_cluster(env, tmp_path):
    pytest.importorskip("ray", reason="the cluster extra is not installed")
    out = tmp_path / "cluster.json"
    args = ("--conversations", "3", "--concurrency", "2", "--max-tokens", "6", "--latency-requests", "5")
    proc = run(env, SCRIPTS / "bench_cluster.py", *args, "--out", out, timeout=600)
    report = json.loads(out.read_text())
    setups = {r["setup"]: r for r in report["setups"]}
    assert set(setups) == {"daemon", "prefix", "least-loaded"}
    for name, r in setups.items():  # every setup replayed every turn of the same conversations
        assert r["turns"] == setups["daemon"]["turns"] >= 9 and r["output_tok_s"] > 0, name
        assert 0 < r["prefix_hit_rate"] < 1  # later turns reuse earlier turns' blocks
        assert re.search(rf"^\| {name} \| {r['turns']} \| [\d.]+ \| \d+ / \d+ \| [\d.]+% \|$", proc.stdout, re.M)
    assert setups["prefix"]["route_decisions"]["hit"] >= setups["daemon"]["turns"] - 3  # every later turn
    assert setups["least-loaded"]["route_decisions"]["least_loaded"] == setups["daemon"]["turns"]
    one = setups["prefix"]["one_token"]
    assert one["ingress_p50_ms"] > 0 and one["direct_p50_ms"] > 0
    added = re.search(r"the ingress adds (-?[\d.]+) ms \(p50\), (-?[\d.]+) ms \(p99\)", proc.stdout)
    assert float(added[1]) == pytest.approx(one["added_p50_ms"], abs=0.06)
    assert float(added[2]) == pytest.approx(one["added_p99_ms"], abs=0.06)
    assert number(r"prefix: the ingress process used [\d.]+ CPU s, ([\d.]+) us per streamed token", proc.stdout) > 0
    assert number(r"([\d.]+) µs to hash its text blocks", proc.stdout) > 0
    assert number(r"([\d.]+) µs to render its chat template and tokenize", proc.stdout) > 0


def test_bench_driver(env):
    proc = run(
        env, SCRIPTS / "bench_driver.py", "--batches", "1,2", "--prompt-len", "8", "--new-tokens", "4", "--repeats", "1"
    )
    assert number(r"batch   1: greedy decode\s+([\d.]+) tok/s", proc.stdout) > 0
    assert number(r"batch   2: greedy decode\s+([\d.]+) tok/s", proc.stdout) > 0
    assert number(r"peak RSS: (\d+) MiB", proc.stdout) > 100 and "load of converted model" in proc.stdout


@pytest.mark.parametrize("weights", ["native", "float32"])
def test_profile_step(env, weights):
    proc = run(
        env, SCRIPTS / "profile_step.py", "--weights", weights, "--rows", "1,3", "--context", "16", "--steps", "2"
    )
    for rows in (1, 3):
        assert number(rf"{rows} running, context ~16: step ([\d.]+) ms", proc.stdout) > 0
    assert number(r"\n  matmul\s+([\d.]+) ms", proc.stdout) > 0
    read = number(r"the matmuls read (\d+) MB of weights per step", proc.stdout)
    # the same model streams 4-bit blocks natively and every matrix in fp32 dequantised
    assert (90 <= read <= 100) if weights == "native" else (500 <= read <= 560), read
    if weights == "native":  # and the prefill of one prompt in one step
        proc = run(env, SCRIPTS / "profile_step.py", "--prefill", "64", "--steps", "2")
        ms, rate = re.search(
            r"a 64-token prompt prefilled in one step: ([\d.]+) ms \(([\d.]+) tok/s", proc.stdout
        ).groups()
        assert float(ms) > 0 and float(rate) == pytest.approx(64 / float(ms) * 1e3, rel=0.01)
        assert number(r"\n  matmul\s+([\d.]+) ms", proc.stdout) > 0


def test_bench_grammar(env, tmp_path):
    out = tmp_path / "grammar.json"
    proc = run(env, SCRIPTS / "bench_grammar.py", "--batch", "2", "--json", out)
    data = json.loads(out.read_text())
    assert len(data["masks"]) == 5 and all(row["llguidance"]["compile_ms"] > 0 for row in data["masks"])
    assert [s["batch"] for s in data["engine_steps"]] == [1, 2]
    assert number(r"batch 2\s+[\d.]+\s+([\d.]+)", proc.stdout) > 0 and "llguidance" in proc.stdout


def test_bench_decode_attention(env):
    proc = run(env, SCRIPTS / "bench_decode_attention.py", "--cases", "1x64,2x32", "--repeats", "1")
    rows = re.findall(r"^\| (\d+ x \d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|$", proc.stdout, re.M)
    assert [r[0] for r in rows] == ["1 x 64", "2 x 32"] and all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows), (
        proc.stdout
    )


def test_bench_quant_matmul(env):
    proc = run(
        env,
        SCRIPTS / "bench_quant_matmul.py",
        "--shape",
        "qwen2.5-0.5b",
        "--types",
        "Q5_0,Q4_K,Q6_K",
        "--rows",
        "1,5",
        "--repeats",
        "1",
    )
    rows = re.findall(
        r"^\| (Q\w+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| [\d.]+ \| ([\d.]+) \| (integer|exact) \|$", proc.stdout, re.M
    )
    assert [(r[0], r[1]) for r in rows] == [("Q5_0", "1"), ("Q5_0", "5")], proc.stdout
    for _, _, exact, fast, ratio, winner in rows:  # the printed times are rounded to 0.01 ms
        assert float(ratio) == pytest.approx(float(exact) / float(fast), rel=0.1)
        assert winner == ("integer" if float(ratio) > 1 else "exact")
    # 896 values per row hold no 256-value blocks (which is why llama-quantize falls back to Q5_0 and Q8_0)
    assert "| Q4_K | - |" in proc.stdout and "| Q6_K | - |" in proc.stdout


def test_make_model(env, tmp_path):
    """The true Qwen2.5-0.5B layer shape (896 wide, 14 heads over 2 KV heads, qkv bias, tied output) with two layers
    and its own 151,936-token vocabulary, quantized to Q5_0 by gguf's quantizer: it loads natively and generates,
    greedy and sampled."""
    out = tmp_path / "qwen-q5_0.gguf"
    proc = run(
        env,
        SCRIPTS / "make_model.py",
        *("--shape", "qwen2.5-0.5b", "--layers", "2", "--quantize", "Q5_0", "--true-vocab", "--out", out),
    )
    assert out.is_file() and f"make_model: {out}" in proc.stdout
    check = (
        "import sys, json; from minibatch.engine.factory import EngineConfig, build_engine\n"
        "from minibatch.engine.core.sampling_params import SamplingParams\n"
        f"e = build_engine(EngineConfig(model={str(out)!r}, num_kv_blocks=16, max_num_seqs=1))\n"
        "r = e.add_request('a', [1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))\n"
        "p = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=3, ignore_eos=True)\n"
        "s = e.add_request('b', [1, 2, 3], p)\n"
        "while e.has_work(): e.step()\n"
        "c = e.runner.model.config\n"
        "print(json.dumps({'weights': e.info.weights, 'family': e.info.family, 'out': r.output_token_ids,\n"
        "  'sampled': s.output_token_ids, 'vocab': c.vocab_size, 'tokenizer': len(e.tokenizer.vocab()),\n"
        "  'shape': [c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.num_layers]}))\n"
    )
    info = json.loads(run(env, "-c", check).stdout.strip().splitlines()[-1])
    assert info["family"] == "qwen2" and info["weights"].startswith("Q5_0") and info["weights"].endswith(" native")
    assert info["shape"] == [896, 14, 2, 64, 4864, 2] and len(info["out"]) == 3 and len(info["sampled"]) == 3
    assert info["vocab"] == info["tokenizer"] == 151936


def test_perplexity(env):
    proc = run(env, SCRIPTS / "perplexity.py", "--chunks", "2", "--ctx", "128")
    rows = {
        r[0]: r[1:]
        for r in re.findall(
            r"^\| ([\w-]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.-]+) \| ([\d.%-]+) \| ([\d.]+) \|$", proc.stdout, re.M
        )
    }
    assert set(rows) == {"native", "native-exact"}, proc.stdout
    ppl = {w: float(v[0]) for w, v in rows.items()}
    assert all(1 < p < 1000 for p in ppl.values()) and abs(ppl["native"] / ppl["native-exact"] - 1) < 0.05
    kl, same = float(rows["native-exact"][2]), float(rows["native-exact"][3].rstrip("%"))
    assert 0 < kl < 0.1 and 80 < same < 100


def test_fuzz_script(env):
    # The deep run with 2 examples per operation and mode: the same check 17, from its own shell script.
    proc = subprocess.run(
        ["bash", str(SCRIPTS / "fuzz.sh"), "2"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**env, "PYTHON": sys.executable},
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fuzz: 2 examples per operation and mode" in proc.stdout
    assert re.search(r"(\d+) passed", proc.stdout) and int(re.search(r"(\d+) passed", proc.stdout).group(1)) >= 30


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


def test_record_quick(env, tmp_path):
    """`make bench`'s pieces with the smallest parameters: a private daemon per model, both modes at two
    points, the sweeps, the prefill; then published into a copy of the docs."""
    docs = tmp_path / "docs"
    (docs / "docs" / "bench").mkdir(parents=True)
    for name in ("README.md", "BENCHMARKS.md"):
        shutil.copy(ROOT / name, docs / name)
    args = ["--quick", "--models", "smollm2-135m-instruct", "--pieces", "serving,modes,sweeps,prefill"]
    args += ["--concurrency", "1,2", "--requests", "3", "--repeats", "1", "--prefill-tokens", "32"]
    proc = run(env, SCRIPTS / "record.py", *args, "--out", tmp_path / "out", "--publish", "--docs", docs, timeout=900)
    [path] = (tmp_path / "out").glob("*/record.json")
    record = json.loads(path.read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert record["run"]["commit"] == head[:12] and record["run"]["quick"] is True
    assert record["run"]["machine"]["cores"] == os.cpu_count() and record["run"]["versions"]["torch"]
    secs = record["sections"]
    assert set(secs) == {"serving", "modes", "variance", "rate", "prefill"}
    [model] = secs["modes"]["models"]
    assert [p["c"] for p in model["points"]] == [1, 2]
    for p in model["points"]:
        for mode in ("continuous", "static"):
            m = p[mode]
            assert m["failed"] == 0 and m["requests"] == 3 and m["tok_s"] > 0 and m["ttft"]["p50"] > 0, (p, mode)
            assert m["e2e"]["p50"] <= m["e2e"]["p95"] <= m["e2e"]["p99"]
        assert p["continuous"]["wasted_row_steps"] == 0 and p["static"]["wasted_row_steps"] >= 0
    assert len(secs["variance"]["points"]) == 5 and len(secs["rate"]["points"]) == 2
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

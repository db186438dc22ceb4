#!/usr/bin/env python3
"""`make bench`: re-measure every figure the README headlines on today's code, and rewrite their tables.

  make bench                                  # the full run (79 minutes on a 2-core Xeon)
  make bench BENCH_ARGS=--quick               # the built-in model, small traces, ~5 minutes; results/ only
  LLAMA_SERVER=... LLAMA_BENCH=... LLAMA_QUANTIZE=... make bench    # with llama.cpp's side too

Pieces (--pieces), each run by the script that owns its method, on private daemons started here:

  serving   per model: the daemon's start time (`minibatchd start` until ready) and its RSS after serving
  modes     per model: static against continuous through the socket, c = 1, 4, 16, 32, 64 (bench.py,
            prompts of 16-64 tokens, outputs of 8-128 forced with ignore_eos, no prefix cache; --prompt-len,
            --output-len), goodput under --slo-ttft / --slo-tpot, wasted row-steps
  sweeps    the built-in model: the output-length-variance sweep (c = 16) and the request-rate sweep
  prefill   per model: one 512-token prompt's prefill step (profile_step.py), llama-bench's pp512 with
            LLAMA_BENCH
  spec      speculation on and off (bench_spec.py: chat, copy-heavy and forced-length prompts, c = 1, 4, 16, 64)
  cluster   one daemon against two minibatch-serve replicas (bench_cluster.py)
  peers     against llama-server on the same files (bench.py --peers), greedy and at the chat's sampling
            defaults, with LLAMA_SERVER; skipped otherwise

Models (--models): the built-in model and `shape:llama-3.2-1b` (--quick: the built-in model alone), a
random-weight GGUF in that model's exact shape that make_model.py writes under results/models when missing:
Q4_K_M by LLAMA_QUANTIZE when given, else Q4_0 by gguf's own quantizers (the nearest type), as it says.

Every run writes each piece's own output and one record.json (the machine, the commit, the versions) under
results/record/STAMP/. A full run then publishes: its sections replace those of docs/bench/record.json,
its plots go to docs/bench/, and scripts/tables.py rewrites the tables between the record's markers in
README.md and BENCHMARKS.md. --quick publishes nothing unless --publish is given.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
sys.path.insert(0, str(SCRIPTS))
import tables  # noqa: E402

BUILTIN = "smollm2-135m-instruct"
PIECES = ("serving", "modes", "sweeps", "prefill", "spec", "cluster", "peers")
# (concurrency, requests, repeats) per point: enough requests that c clients are really in flight
FULL_POINTS = {
    "small": [(1, 16, 3), (4, 32, 3), (16, 64, 3), (32, 96, 1), (64, 128, 1)],
    "large": [(1, 8, 3), (4, 16, 3), (16, 48, 1), (32, 64, 1), (64, 128, 1)],
}
QUICK_POINTS = [(1, 4, 1), (4, 8, 1), (16, 16, 1)]
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "amx_int8")


def machine() -> dict:
    """What the figures were measured on: CPU model and the flags our kernels choose by, cores, memory."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    mem = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {
        "cpu": model,
        "flags": [f for f in FLAGS if f in flags],
        "cores": os.cpu_count(),
        "memory_gib": round(mem / 2**30, 1),
        "system": f"{platform.system()} {platform.release()}",
    }


def git(*argv: str) -> str:
    out = subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


def versions(llama: dict[str, str | None]) -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "aiohttp", "textual"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - a missing optional package is simply not listed
            pass
    if llama.get("server"):
        done = subprocess.run([llama["server"], "--version"], capture_output=True, text=True, timeout=60)
        out["llama.cpp"] = (done.stdout + done.stderr).strip().splitlines()[0:1] or ["?"]
        out["llama.cpp"] = out["llama.cpp"][0]
    return out


# what a published run itself rewrites: a change there (an earlier run's tables) does not make the code dirty
OWN_OUTPUTS = [f":!{p}" for p in (*tables.DOCS, str(tables.RECORD.parent))]


class Run:
    """One `make bench`: its folder, the sections it measures, what it says as it goes."""

    def __init__(self, args) -> None:
        self.args = args
        self.started = time.monotonic()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.out = Path(args.out) / stamp
        self.out.mkdir(parents=True, exist_ok=True)
        commit = git("rev-parse", "HEAD")
        self.stamp = {
            "date": time.strftime("%Y-%m-%d"),
            "commit": commit[:12],
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no", "--", ".", *OWN_OUTPUTS)),
            "quick": bool(args.quick),
            "machine": machine(),
            "versions": versions(args.llama),
        }
        self.sections: dict[str, dict] = {}
        self.notes: list[str] = []

    def say(self, text: str) -> None:
        print(f"record: {text}", file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        self.notes.append(text)
        self.say(text)

    def script(self, name: str, *argv: str, log: str) -> None:
        """Run one of the scripts; its output goes to a log beside its JSON, its failure stops the run."""
        cmd = [sys.executable, str(SCRIPTS / name), *argv]
        self.say(" ".join([name, *argv]))
        with (self.out / log).open("w") as f:
            done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=self.env())
        if done.returncode != 0:
            tail = "\n".join((self.out / log).read_text(errors="replace").splitlines()[-15:])
            raise SystemExit(f"record: {name} failed ({done.returncode}); the end of {self.out / log}:\n{tail}")

    def env(self) -> dict:
        return {**os.environ, "TQDM_DISABLE": "1"}

    def section(self, name: str, body: dict) -> None:
        self.sections[name] = {"run": self.stamp, **body}
        self.save()

    def save(self) -> Path:
        path = self.out / "record.json"
        body = {
            "run": self.stamp | {"wall_s": round(time.monotonic() - self.started)},
            "notes": self.notes,
            "sections": self.sections,
        }
        path.write_text(json.dumps(body, indent=1) + "\n")
        return path


class Model:
    """A model the record measures: what the daemon is given, what the tables call it, its file."""

    def __init__(self, spec: str, run: Run) -> None:
        from minibatch.engine.store.cache import BUILTIN_MODELS, builtin_gguf_path

        self.spec, self.large = spec, spec.startswith("shape:")
        if spec == BUILTIN:
            self.file = builtin_gguf_path(BUILTIN_MODELS[BUILTIN])
            self.label, self.key = "built-in 135M Q4_1", "builtin"
        elif self.large:
            self.file, self.label = make_shape(spec.removeprefix("shape:"), run)
            self.key = spec.removeprefix("shape:")
            self.spec = str(self.file)
        else:
            self.file = Path(spec) if Path(spec).is_file() else None
            self.label, self.key = Path(spec).name, Path(spec).stem

    def info(self) -> dict:
        return {"key": self.key, "label": self.label, "file_mb": self.file_mb()}

    def file_mb(self) -> float | None:
        return round(self.file.stat().st_size / 1e6, 1) if self.file else None


def make_shape(shape: str, run: Run) -> tuple[Path, str]:
    quantize = run.args.llama["quantize"]
    qtype = "Q4_K_M" if quantize else "Q4_0"
    path = ROOT / "results" / "models" / f"{shape}.{qtype}.gguf"
    how = "llama-quantize" if quantize else "gguf's own quantizer (no LLAMA_QUANTIZE given)"
    if not path.exists():
        argv = ["--shape", shape, "--out", str(path), "--quantize", qtype]
        run.script(
            "dev/make_model.py", *argv, *(["--llama-quantize", quantize] if quantize else []), log="make_model.log"
        )
    run.note(f"{shape}: random weights in the model's shape, {qtype} by {how}: {path.name}")
    return path, f"{shape} shape {qtype}"


class Daemon:
    """A private minibatchd on its own socket, timed from `start` to ready."""

    def __init__(self, run: Run, model: Model, *extra: str) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="mb-record-", dir="/tmp"))
        os.chmod(self.folder, 0o700)
        self.socket = str(self.folder / "d.sock")
        cmd = [sys.executable, "-m", "minibatch.daemon.cli", "start", "--socket", self.socket, "--model", model.spec]
        cmd += ["--log-file", str(self.folder / "d.log"), "--max-queue", "4096", *extra]
        t = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True, env=run.env())
        self.start_s = time.monotonic() - t
        if done.returncode != 0:
            raise SystemExit(f"record: minibatchd start failed ({done.returncode}):\n{done.stderr[-2000:]}")
        self.health = self.get("/health")

    def get(self, path: str) -> dict:
        from minibatch.daemon.client import request_json

        status, body = request_json(self.socket, "GET", path, timeout=60)
        if status != 200:
            raise RuntimeError(f"{path}: HTTP {status}: {body}")
        return body

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.health['pid']}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def stop(self) -> None:
        subprocess.run(
            [sys.executable, "-m", "minibatch.daemon.cli", "stop", "--socket", self.socket],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        shutil.rmtree(self.folder, ignore_errors=True)


def lite(summary: dict, engine: dict) -> dict:
    """The figures the tables use from one bench.py row (its medians)."""
    pick = ("p50", "p95", "p99")
    return {
        "tok_s": summary["output_throughput"],
        "req_s": summary["request_throughput"],
        "goodput": summary["goodput"],
        "requests": summary["requests"],
        "failed": summary["failed"],
        "ttft": {k: summary["ttft"][k] for k in pick},
        "tpot": {k: summary["tpot"][k] for k in pick},
        "e2e": {k: summary["e2e"][k] for k in pick},
        "mean_running": engine.get("mean_running"),
        "wasted_row_steps": engine.get("wasted_row_steps"),
        "preemptions": engine.get("preemptions"),
    }


def bench_rows(folder: Path) -> list[dict]:
    return json.loads((folder / "summary.json").read_text())["rows"]


def trace(args) -> list[str]:
    """bench.py's trace options for the modes and the sweeps."""
    return ["--prompt-len", args.prompt_len, "--output-len", args.output_len, "--workload", "synthetic"]


def modes(run: Run, model: Model, daemon: Daemon) -> dict:
    args = run.args
    plan = QUICK_POINTS if args.quick else FULL_POINTS["large" if model.large else "small"]
    if args.concurrency:  # the plan's point where it has one, else 2c requests once
        known = {c: (c, n, r) for c, n, r in plan}
        plan = [known.get(c, (c, max(2, 2 * c), 1)) for c in args.concurrency]
    points = []
    for c, n, reps in plan:
        n, reps = args.requests or n, args.repeats or reps
        folder = run.out / f"modes-{model.key}-c{c}"
        slo = ["--slo-ttft", str(args.slo_ttft), "--slo-tpot", str(args.slo_tpot)]
        argv = ["--socket", daemon.socket, "--out", str(folder), *trace(args), *slo]
        argv += ["--concurrency", str(c), "--requests", str(n), "--repeats", str(reps), "--seed", "0"]
        run.script("bench.py", *argv, log=f"modes-{model.key}-c{c}.log")
        by_mode = {r["variant"]: lite(r["summary"], r["engine"]) for r in bench_rows(folder)}
        points.append({"c": c, "requests": n, "repeats": reps, **by_mode})
    return model.info() | {"points": points}


def sweeps(run: Run, model: Model, daemon: Daemon) -> None:
    q, n = run.args.quick, run.args.requests
    out = {}
    for name, argv in (
        ("variance", ["--sweep", "variance", "--concurrency", "16", "--requests", str(n or (8 if q else 48))]),
        ("rate", ["--sweep", "rate:2,8" if q else "rate:1,2,4,8", "--requests", str(n or (8 if q else 48))]),
    ):
        folder = run.out / f"sweep-{name}"
        slo = ["--slo-ttft", str(run.args.slo_ttft), "--slo-tpot", str(run.args.slo_tpot)]
        run.script(
            "bench.py",
            *["--socket", daemon.socket, "--out", str(folder), *trace(run.args), *slo, *argv, "--repeats", "1"],
            log=f"sweep-{name}.log",
        )
        rows = bench_rows(folder)
        points = {}
        for r in rows:
            points.setdefault(r["point"], {"point": r["point"], "x": r["x"]})[r["variant"]] = lite(
                r["summary"], r["engine"]
            )
        out[name] = model.info() | {"points": list(points.values())}
    run.section("variance", out["variance"])
    run.section("rate", out["rate"])


def prefill(run: Run, models: list[Model]) -> None:
    rows = []
    for m in models:
        path = run.out / f"prefill-{m.key}.json"
        steps, tokens = ("2" if run.args.quick else "5"), run.args.prefill_tokens
        argv = ["--model", m.spec, "--prefill", str(tokens), "--steps", steps, "--json", str(path)]
        run.script("kernels/profile_step.py", *argv, log=f"prefill-{m.key}.log")
        ms = json.loads(path.read_text())["steps"][0]["step_ms"]
        row = m.info() | {"tokens": tokens, "step_ms": ms, "tok_s": tokens / ms * 1e3, "llama_bench_tok_s": None}
        if run.args.llama["bench"] and m.file:
            row["llama_bench_tok_s"] = llama_bench(run, m)
        rows.append(row)
    run.section("prefill", {"rows": rows})


def llama_bench(run: Run, m: Model) -> float:
    argv = [
        run.args.llama["bench"],
        "-m",
        str(m.file),
        "-p",
        str(run.args.prefill_tokens),
        "-n",
        "0",
        "-t",
        str(os.cpu_count()),
        "-o",
        "json",
    ]
    run.say(" ".join(argv))
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    (run.out / f"llama-bench-{m.key}.json").write_text(done.stdout)
    return float(json.loads(done.stdout)[0]["avg_ts"])


def spec(run: Run) -> None:
    q = run.args.quick
    path = run.out / "spec.json"
    argv = ["--workloads", "copy" if q else "chat,copy,forced", "--concurrency", "1" if q else "1,4,16,64"]
    argv += ["--repeats", "1" if q else "3", "--max-tokens", "32" if q else "96", "--json", str(path)]
    run.script("features/bench_spec.py", *argv, log="spec.log")
    run.section("spec", {"rows": json.loads(path.read_text())})


def cluster(run: Run) -> None:
    q = run.args.quick
    path = run.out / "cluster.json"
    argv = ["--out", str(path)]
    if q:
        argv += ["--conversations", "4", "--concurrency", "2", "--max-tokens", "16", "--latency-requests", "10"]
    run.script("features/bench_cluster.py", *argv, log="cluster.log")
    report = json.loads(path.read_text())
    run.section("cluster", {"setups": report["setups"], "key_cost": report["key_cost"]})


def peers(run: Run, models: list[Model]) -> None:
    """Each model against llama-server, greedy and then at the chat's sampling defaults (both servers sample)."""
    server = run.args.llama["server"]
    if not server:
        run.note("peers: skipped (no LLAMA_SERVER given: the path of a llama-server built for this CPU)")
        return
    out = []
    for m in models:
        which = (
            "minibatch:native,llama.cpp:Q4_1,llama.cpp:Q8_0" if m.spec == BUILTIN else "minibatch:native,llama.cpp:file"
        )
        rows = []
        for sampling in ("greedy", "chat"):
            folder = run.out / f"peers-{m.key}-{sampling}"
            argv = ["--peers", which, "--llama-server", server, "--out", str(folder), "--per-client", "2"]
            argv += ["--concurrencies", "1,4" if run.args.quick else "1,16,64"]
            argv += ["--requests", "8" if run.args.quick else "48" if m.spec == BUILTIN else "32"]
            argv += ["--repeats", "1" if run.args.quick else "3", "--sampling", sampling]
            if m.spec != BUILTIN:
                argv += ["--model", m.spec]
            run.script("bench.py", *argv, log=f"peers-{m.key}-{sampling}.log")
            rows += [
                {"c": r["concurrency"], "server": r["server"], "sampling": sampling, **lite(r["summary"], {})}
                | {"rss_peak_mb": r.get("rss_peak_mb"), "rss_after_mb": r.get("rss_after_mb")}
                for r in json.loads((folder / "peers.json").read_text())["rows"]
            ]
        out.append(m.info() | {"rows": rows})
    run.section("peers", {"models": out})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small traces and one repetition: a few minutes")
    ap.add_argument(
        "--models",
        default=None,
        help=f"comma list: alias, file or shape:NAME (default {BUILTIN},shape:llama-3.2-1b; with --quick {BUILTIN})",
    )
    ap.add_argument("--pieces", default=",".join(PIECES), help="comma list of " + ", ".join(PIECES))
    ap.add_argument(
        "--concurrency", type=lambda v: [int(x) for x in v.split(",")], default=None, help="modes: only these"
    )
    ap.add_argument(
        "--requests", type=int, default=None, help="modes, sweeps: requests per point (default: the plan's)"
    )
    ap.add_argument("--prompt-len", default="16,64", help="modes, sweeps: prompt lengths, lo,hi tokens")
    ap.add_argument("--output-len", default="8,128", help="modes, sweeps: output lengths, lo,hi tokens")
    ap.add_argument("--prefill-tokens", type=int, default=512, help="prefill: the prompt's length (as llama-bench -p)")
    ap.add_argument("--repeats", type=int, default=None, help="modes: repetitions per point (default: the plan's)")
    ap.add_argument("--slo-ttft", type=float, default=2.0, help="goodput: TTFT at most this many seconds")
    ap.add_argument("--slo-tpot", type=float, default=0.1, help="goodput: TPOT at most this many seconds")
    ap.add_argument("--out", default=str(ROOT / "results" / "record"))
    ap.add_argument("--publish", action=argparse.BooleanOptionalAction, default=None, help="default: on unless --quick")
    ap.add_argument("--docs", default=str(ROOT), help="where README.md, BENCHMARKS.md and docs/bench/ are")
    args = ap.parse_args()
    pieces = args.pieces.split(",")
    unknown = sorted(set(pieces) - set(PIECES))
    if unknown:
        ap.error(f"--pieces: unknown {', '.join(unknown)}; choose from {', '.join(PIECES)}")
    args.llama = {k: os.environ.get(f"LLAMA_{k.upper()}") or None for k in ("server", "bench", "quantize")}
    run = Run(args)
    run.say(f"{run.out} (commit {run.stamp['commit']}{' + changes' if run.stamp['dirty'] else ''})")
    specs = args.models or (BUILTIN if args.quick else f"{BUILTIN},shape:llama-3.2-1b")
    models = [Model(spec, run) for spec in specs.split(",")]
    per_model = []
    for m in models:
        if not ({"serving", "modes", "sweeps"} & set(pieces)):
            break
        daemon = Daemon(run, m, "--max-num-seqs", "64", "--no-prefix-caching")
        try:
            entry = m.info() | {"start_s": round(daemon.start_s, 2), "speculative": daemon.health.get("speculative")}
            entry["weights"] = daemon.health.get("weights")
            if "modes" in pieces:
                per_model.append(modes(run, m, daemon))
            if "sweeps" in pieces and m is models[0]:
                sweeps(run, m, daemon)
            time.sleep(1.0)
            entry["rss_after_mb"] = round(daemon.rss_mb(), 1)
            entry["kv_cache_mb"] = round(daemon.health.get("kv_cache_bytes", 0) / 1e6)
            if "serving" in pieces:
                run.sections.setdefault("serving", {"run": run.stamp, "rows": []})["rows"].append(entry)
                run.save()
        finally:
            daemon.stop()
    if per_model:
        run.section(
            "modes",
            {
                "trace": f"synthetic prompts of {'-'.join(args.prompt_len.split(','))} tokens, outputs of "
                f"{'-'.join(args.output_len.split(','))} forced with ignore_eos, all at once, c in flight; "
                "--max-num-seqs 64, no prefix cache, the daemon's other defaults",
                "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
                "models": per_model,
            },
        )
    if "prefill" in pieces:
        prefill(run, models)
    if "spec" in pieces:
        spec(run)
    if "cluster" in pieces:
        cluster(run)
    if "peers" in pieces:
        peers(run, models)
    path = run.save()
    run.say(f"done in {time.monotonic() - run.started:.0f} s: {path}")
    for plot in tables.plots(json.loads(path.read_text()), run.out):
        run.say(f"plot: {plot}")
    if args.publish if args.publish is not None else not args.quick:
        for line in tables.publish(path, Path(args.docs)):
            run.say(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

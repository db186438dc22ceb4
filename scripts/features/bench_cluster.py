"""Past one machine, measured on this one: a daemon against replicas behind minibatch-serve, in one run.

Three setups, one at a time on the same cores, each replaying the same
multi-turn chat trace (conversations from the bundled chat set, 3-5 turns
each, the next turn sent when its answer has arrived, `--concurrency`
conversations at once, greedy with fixed output lengths so every setup does
the same work):

  daemon        one minibatchd with --threads T (default: all cores)
  prefix        minibatch-serve, R replicas x T/R threads, prefix-aware routing
  least-loaded  the same replicas, prefix routing off (each request to the least loaded replica)
  prefix@MS     prefix routing with each stream's chunks coalesced over MS ms (--stream-interval-ms)

For each: output tokens/s, TTFT p50/p95, the prefix cache's hit rate over the
trace (cached prompt tokens / prompt tokens, from /v1/engine/stats), and for
the cluster setups the router's decisions. Then, on the prefix cluster, what
the ingress adds to a request: 1-token requests sent alternately through the
ingress and straight to a replica's own daemon socket (p50/p99 of each and the
difference), and what the routing key costs the ingress per request: the
prompt's text block hashes against rendering the chat template and
tokenizing. Writes a JSON report (--out) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import CHAT_SET  # noqa: E402
from loadgen import percentile, session, stream_request  # noqa: E402
from tables import cluster as table  # noqa: E402  (the layout the record's tables use)

from minibatch.daemon.client import UnixHTTPConnection, request_json  # noqa: E402

FOLLOW_UPS = (
    "Tell me more about that.",
    "Give one concrete example.",
    "Summarize your answer in one sentence.",
    "What is a common mistake here?",
    "Why does that matter?",
)


def conversations(n: int, seed: int, max_tokens: int) -> list[list[tuple[str, int]]]:
    """n conversations: (user text, output tokens) per turn, 3-5 turns, openers from the chat set."""
    rows = [json.loads(line) for line in CHAT_SET.read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    out = []
    for row in rng.sample(rows, min(n, len(rows))):
        turns = [(row["prompt"], min(row["max_tokens"], max_tokens))]
        for text in rng.sample(FOLLOW_UPS, rng.randint(2, 4)):
            turns.append((text, rng.randint(max_tokens // 4, max_tokens)))
        out.append(turns)
    return out


async def replay(sock: str, convos: list, concurrency: int) -> tuple[list, float]:
    """Every conversation turn by turn (the answer goes into the next turn), `concurrency` at once."""
    results, queue = [], list(enumerate(convos))
    async with session(sock) as s:

        async def worker() -> None:
            while queue:
                i, turns = queue.pop(0)
                messages: list[dict] = []
                for text, n in turns:
                    messages.append({"role": "user", "content": text})
                    body = {"messages": messages, "max_tokens": n, "temperature": 0, "ignore_eos": True}
                    res = await stream_request(s, i, body)
                    if not res.ok:
                        raise RuntimeError(f"conversation {i}: {res.error}")
                    results.append(res)
                    messages.append({"role": "assistant", "content": res.text})

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.monotonic() - t0


def stats_of(sock: str) -> dict:
    return request_json(sock, "GET", "/v1/engine/stats?steps=0", timeout=30)[1]


def decisions(sock: str) -> dict[str, float]:
    conn = UnixHTTPConnection(sock, 30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out = {}
    for line in text.splitlines():
        if line.startswith("minibatch_cluster_route_decisions_total{"):
            out[line.split('"')[1]] = float(line.split()[-1])
    return out


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_token_ms(sock: str, n: int) -> list[float]:
    """Wall time of n sequential 1-token completions over a Unix socket (a fresh connection each, as a client
    opening one per request would)."""
    body = json.dumps({"prompt": "Hi", "max_tokens": 1, "temperature": 0})
    times = []
    for _ in range(n):
        t = time.perf_counter()
        conn = UnixHTTPConnection(sock, 30)
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        conn.close()
        assert resp.status == 200, resp.status
        times.append(1000 * (time.perf_counter() - t))
    return times


def key_cost(convos: list) -> dict:
    """Microseconds per request to make the routing key: text block hashes, or the chat template + tokenizer."""
    from minibatch.daemon.cluster.prefix import block_hashes, prompt_segments
    from minibatch.engine.store.cache import resolve_model
    from minibatch.engine.text.tokenizer import TextTokenizer

    tok = TextTokenizer(resolve_model("smollm2-135m-instruct"))
    requests = []
    for turns in convos:  # every turn's messages, with stand-in answers of the trace's lengths
        messages: list[dict] = []
        for text, n in turns:
            messages.append({"role": "user", "content": text})
            requests.append(list(messages))
            messages.append({"role": "assistant", "content": "word " * n})

    def per_request(fn) -> float:
        runs = []
        for _ in range(5):
            t = time.perf_counter()
            for m in requests:
                fn(m)
            runs.append(1e6 * (time.perf_counter() - t) / len(requests))
        return statistics.median(runs)

    return {
        "requests": len(requests),
        "hash_us": per_request(lambda m: block_hashes(prompt_segments("/v1/chat/completions", {"messages": m}))),
        "tokenize_us": per_request(lambda m: tok.chat(m)),
    }


def start(setup: str, folder: Path, args) -> tuple[list[str], str]:
    kind, _, interval = setup.partition("@")
    name = setup.replace("@", "-")
    sock = str(folder / f"{name}.sock")
    common = ["--socket", sock, "--log-file", str(folder / f"{name}.log"), "--kv-cache-tokens", str(args.kv_tokens)]
    if kind == "daemon":
        cli = [sys.executable, "-m", "minibatch.daemon.cli"]
        extra = ["--threads", str(args.threads)]
    else:
        cli = [sys.executable, "-m", "minibatch.daemon.cluster.cli"]
        per = max(1, args.threads // args.replicas)
        extra = ["--replicas", str(args.replicas), "--threads", str(per), "--routing", kind]
        extra += ["--stream-interval-ms", interval or "0"]
    subprocess.run([*cli, "start", *common, *extra], check=True, stdout=subprocess.DEVNULL)
    return cli, sock


def run_setup(kind: str, folder: Path, convos: list, args) -> dict:
    """One setup (`daemon`, `prefix`, `least-loaded`, `prefix@MS`) started, replayed, measured and stopped."""
    cli, sock = start(kind, folder, args)
    try:
        pid = request_json(sock, "GET", "/health", timeout=30)[1]["pid"]  # the daemon's, or the ingress's
        before, cpu0 = stats_of(sock), cpu_seconds(pid)
        results, wall = asyncio.run(replay(sock, convos, args.concurrency))
        cpu1, after = cpu_seconds(pid), stats_of(sock)
        prompt = after["prompt_tokens"] - before["prompt_tokens"]
        cached = after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
        ttfts = [r.ttft for r in results]
        out = {
            "setup": kind,
            "turns": len(results),
            "wall_s": wall,
            "output_tok_s": sum(r.output_tokens for r in results) / wall,
            "ttft_p50_ms": 1000 * percentile(ttfts, 50),
            "ttft_p95_ms": 1000 * percentile(ttfts, 95),
            "prefix_hit_rate": cached / prompt if prompt else 0.0,
        }
        if kind != "daemon":  # what relaying costs the ingress's one process
            out["ingress_cpu_s"] = cpu1 - cpu0
            out["ingress_cpu_us_per_token"] = 1e6 * (cpu1 - cpu0) / sum(r.output_tokens for r in results)
            out["route_decisions"] = decisions(sock)
            out["per_replica_prompt_tokens"] = {r["replica"]: r["prompt_tokens"] for r in after["replicas"]}
        if kind == "prefix":
            status, health = request_json(sock, "GET", "/health", timeout=30)
            direct = health["cluster"]["replicas"][0]["socket"]
            via, straight = [], []
            for _ in range(args.latency_requests):  # alternate, so both see the same machine
                via += one_token_ms(sock, 1)
                straight += one_token_ms(direct, 1)
            out["one_token"] = {
                "n": args.latency_requests,
                "ingress_p50_ms": percentile(via, 50),
                "ingress_p99_ms": percentile(via, 99),
                "direct_p50_ms": percentile(straight, 50),
                "direct_p99_ms": percentile(straight, 99),
                "added_p50_ms": percentile(via, 50) - percentile(straight, 50),
                "added_p99_ms": percentile(via, 99) - percentile(straight, 99),
            }
        return out
    finally:
        subprocess.run([*cli, "stop", "--socket", sock], stdout=subprocess.DEVNULL, timeout=180)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8, help="conversations in flight at once")
    ap.add_argument("--max-tokens", type=int, default=48, help="output tokens per turn at most")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="the machine's threads, shared out")
    ap.add_argument("--kv-tokens", type=int, default=16384, help="KV cache per engine, in tokens")
    ap.add_argument("--latency-requests", type=int, default=100)
    ap.add_argument("--setups", default="daemon,prefix,least-loaded")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="JSON report")
    args = ap.parse_args()
    convos = conversations(args.conversations, args.seed, args.max_tokens)
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "key_cost": key_cost(convos), "setups": []}
    with tempfile.TemporaryDirectory(prefix="mbcl-", dir="/tmp") as d:
        os.chmod(d, 0o700)
        for kind in args.setups.split(","):
            print(f"{kind}: running {len(convos)} conversations…", file=sys.stderr, flush=True)
            report["setups"].append(run_setup(kind, Path(d), convos, args))
    print(table(report))
    for r in report["setups"]:
        if "ingress_cpu_us_per_token" in r:
            print(f"{r['setup']}: the ingress process used {r['ingress_cpu_s']:.1f} CPU s, "
                  f"{r['ingress_cpu_us_per_token']:.0f} us per streamed token")  # fmt: skip
        if "route_decisions" in r:
            print(f"{r['setup']}: route decisions {r['route_decisions']}, prompt tokens per replica "
                  f"{r['per_replica_prompt_tokens']}")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

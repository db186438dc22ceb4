"""Soak minibatchd: Poisson load near capacity with cancellations, bounded by time and request count.

  .venv/bin/python scripts/soak.py --minutes 10 --rate 1.0

Every minute (--window) it prints the daemon's RSS, its open file descriptors, KV usage,
and the p99 TTFT of that window; at the end, a verdict against the targets:
RSS growth < 5%, open fds stable, KV back to the idle baseline, p99 TTFT drift
< 10% between the first and the last window.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import env_socket, percentile, session, stream_request  # noqa: E402

PROMPTS = [line for line in (Path(__file__).parent / "data" / "chat_prompts.jsonl").read_text().splitlines() if line]


def proc_stats(pid: int) -> tuple[int, int]:
    """(RSS in KiB, open file descriptors) of the daemon process."""
    rss = next(int(line.split()[1]) for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


async def main_async(args) -> int:
    import json

    rng = random.Random(args.seed)
    unit = "min" if args.window == 60 else f"{args.window:g}s"
    async with session(args.socket) as s:
        async with s.get("/health") as r:
            health = await r.json()
        pid = health["pid"]
        async with s.get("/v1/engine/stats?steps=0") as r:
            baseline_kv = (await r.json())["kv_blocks_used"]
        minutes: list[dict] = []
        current = {"ttft": [], "ok": 0, "cancelled": 0, "failed": 0}
        tasks: set[asyncio.Task] = set()
        start = time.monotonic()
        sent = 0

        async def one(i: int) -> None:
            row = json.loads(PROMPTS[rng.randrange(len(PROMPTS))])
            body = {
                "messages": [{"role": "user", "content": row["prompt"]}],
                "max_tokens": min(row["max_tokens"], args.max_tokens),
            }
            bucket = current
            if rng.random() < args.cancel:
                task = asyncio.ensure_future(stream_request(s, i, body))
                await asyncio.sleep(rng.uniform(0.2, 3.0))
                task.cancel()
                bucket["cancelled"] += 1
                return
            res = await stream_request(s, i, body)
            if res.ok:
                bucket["ok"] += 1
                bucket["ttft"].append(res.ttft)
            else:
                bucket["failed"] += 1

        next_report = start + args.window
        while time.monotonic() - start < args.minutes * 60 and sent < args.max_requests:
            await asyncio.sleep(rng.expovariate(args.rate))
            t = asyncio.create_task(one(sent))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            sent += 1
            if time.monotonic() >= next_report:
                rss, fds = proc_stats(pid)
                async with s.get("/v1/engine/stats?steps=0") as r:
                    st = await r.json()
                p99 = percentile(current["ttft"], 99)
                minutes.append(
                    {
                        "minute": len(minutes) + 1,
                        "rss_kib": rss,
                        "fds": fds,
                        "kv_percent": st["kv_usage_percent"],
                        "p99_ttft": p99,
                        **{k: current[k] for k in ("ok", "cancelled", "failed")},
                    }
                )
                m = minutes[-1]
                print(
                    f"{unit} {m['minute']:>3}: RSS {rss / 1024:7.1f} MiB  fds {fds:4d}  KV {m['kv_percent']:5.1f}%  "
                    f"p99 TTFT {p99 if p99 is None else f'{p99:.2f} s'}  "
                    f"ok {m['ok']} cancelled {m['cancelled']} failed {m['failed']}",
                    flush=True,
                )
                current = {"ttft": [], "ok": 0, "cancelled": 0, "failed": 0}
                next_report += args.window
        await asyncio.gather(*tasks, return_exceptions=True)
        for _ in range(600):
            async with s.get("/v1/engine/stats?steps=0") as r:
                st = await r.json()
            if st["running"] == 0 and st["waiting"] == 0:
                break
            await asyncio.sleep(0.1)
        rss_end, fds_end = proc_stats(pid)
    if len(minutes) < 2:
        print(f"soak: too short for a verdict (need at least two windows of {args.window:g} s)")
        return 1
    first, last = minutes[0], minutes[-1]
    rss_growth = (rss_end - first["rss_kib"]) / first["rss_kib"]
    drift = (
        (last["p99_ttft"] - first["p99_ttft"]) / first["p99_ttft"] if first["p99_ttft"] and last["p99_ttft"] else None
    )
    checks = {
        "RSS growth < 5%": rss_growth < 0.05,
        f"open fds stable (within 5 of {unit} 1)": abs(fds_end - first["fds"]) <= 5,
        "KV back to idle baseline": st["kv_blocks_used"] == baseline_kv,
        "p99 TTFT drift < 10%": drift is not None and drift < 0.10,
        "no failed requests": all(m["failed"] == 0 for m in minutes),
    }
    print(
        f"\nsent {sent} requests in {(time.monotonic() - start) / 60:.1f} min; RSS {first['rss_kib'] / 1024:.1f} -> "
        f"{rss_end / 1024:.1f} MiB ({100 * rss_growth:+.1f}%), fds {first['fds']} -> {fds_end}, KV used at rest "
        f"{st['kv_blocks_used']} (baseline {baseline_kv}), p99 TTFT first {first['p99_ttft']} last {last['p99_ttft']} "
        f"(drift {'n/a' if drift is None else f'{100 * drift:+.1f}%'})"
    )
    for name, ok in checks.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    return 0 if all(checks.values()) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--socket", default=None)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--max-requests", type=int, default=100_000)
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    ap.add_argument("--cancel", type=float, default=0.10, help="fraction of requests cancelled mid-way")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--window", type=float, default=60, help="seconds per report line (the verdict compares the first and last)"
    )
    args = ap.parse_args()
    args.socket = env_socket(args.socket)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())

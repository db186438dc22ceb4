"""The daemon's overhead: the same trace in-process (LLMEngine) and through the socket (64 streams).

  .venv/bin/python scripts/features/bench_overhead.py [--requests 64] [--repeats 3]

Both sides run continuous batching with the same engine settings; the socket
side starts its own minibatchd on a temporary socket and streams every request
as SSE. Reports output tokens/s for each and the ratio (median of --repeats).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from loadgen import session, stream_request  # noqa: E402


def trace(n: int, seed: int):
    rng = random.Random(seed)
    return [([rng.randrange(200, 40000) for _ in range(rng.randint(32, 128))], rng.randint(64, 192)) for _ in range(n)]


def in_process(items, args) -> float:
    from minibatch.engine.core.sampling_params import SamplingParams
    from minibatch.engine.factory import EngineConfig, build_engine

    engine = build_engine(EngineConfig(max_num_seqs=args.requests, max_num_batched_tokens=args.budget, kv_cache_gb=2.0))
    rates = []
    for rep in range(args.repeats):
        t0 = time.monotonic()
        for i, (p, n) in enumerate(items):
            engine.add_request(f"r{rep}-{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        while engine.has_work():
            engine.step()
        rates.append(sum(n for _, n in items) / (time.monotonic() - t0))
    return statistics.median(rates)


async def over_socket(items, args, sock: str) -> float:
    rates = []
    async with session(sock) as s:
        for _ in range(args.repeats):
            t0 = time.monotonic()
            results = await asyncio.gather(
                *(
                    stream_request(
                        s, i, {"prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True}, chat=False
                    )
                    for i, (p, n) in enumerate(items)
                )
            )
            wall = time.monotonic() - t0
            assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
            rates.append(sum(r.output_tokens for r in results) / wall)
    return statistics.median(rates)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    items = trace(args.requests, args.seed)
    local = in_process(items, args)
    print(f"in-process: {local:.1f} output tok/s", flush=True)
    with tempfile.TemporaryDirectory(prefix="mbo-", dir="/tmp") as d:
        sock = str(Path(d) / "d.sock")
        cli = [sys.executable, "-m", "minibatch.daemon.cli"]
        # `minibatchd start` returns once the daemon answers /health (or fails with the reason)
        subprocess.run(
            [
                *cli,
                "start",
                "--socket",
                sock,
                "--log-file",
                str(Path(d) / "d.log"),
                "--max-num-seqs",
                str(args.requests),
                "--max-num-batched-tokens",
                str(args.budget),
                "--kv-cache-gb",
                "2.0",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        try:
            remote = asyncio.run(over_socket(items, args, sock))
        finally:
            subprocess.run([*cli, "stop", "--socket", sock], stdout=subprocess.DEVNULL)
    print(f"through the socket ({args.requests} concurrent SSE streams): {remote:.1f} output tok/s")
    print(f"socket / in-process: {remote / local:.3f} (overhead {100 * (1 - remote / local):.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

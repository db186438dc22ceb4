"""Fire N concurrent prompts at minibatchd and watch them come back.

  .venv/bin/python scripts/fire.py                 # 8 built-in prompts at once
  .venv/bin/python scripts/fire.py -n 32 --max-tokens 64
  .venv/bin/python scripts/fire.py --prompt "Tell me a joke" -n 16
  .venv/bin/python scripts/fire.py --file prompts.txt   # one prompt per line

Prints one line per request as it finishes (TTFT, tokens, tokens/s, finish
reason, the first words of the answer) and a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import env_socket, percentile, session, stream_request  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a ten-year-old.",
    "Give me three tips for a good night's sleep.",
    "What is the difference between a list and a tuple in Python?",
    "Name the planets of the solar system.",
    "Write a short story about a robot who learns to paint.",
    "How do vaccines work?",
    "Translate 'thank you very much' into Spanish, French and German.",
    "What causes the seasons on Earth?",
    "Suggest a name for a coffee shop run by cats.",
    "Summarize the rules of chess in a few sentences.",
    "Why is the sky blue?",
    "Write a limerick about a forgetful wizard.",
    "What are the benefits of regular exercise?",
    "Describe a sunset to someone who has never seen one.",
]


async def run(args) -> int:
    if args.prompt:
        prompts = [args.prompt]
    elif args.file:
        prompts = [line.strip() for line in Path(args.file).read_text().splitlines() if line.strip()]
    else:
        prompts = PROMPTS
    chosen = list(itertools.islice(itertools.cycle(prompts), args.n))
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.ignore_eos:
        params["ignore_eos"] = True
    async with session(args.socket, args.url, args.api_key) as s:
        if args.mode:
            async with s.put("/v1/engine/mode", json={"mode": args.mode}) as r:
                if r.status >= 400:
                    print(f"fire: mode switch failed: {await r.text()}", file=sys.stderr)
                    return 1
        started = time.monotonic()
        tasks = [
            asyncio.create_task(stream_request(s, i, {"messages": [{"role": "user", "content": p}], **params}))
            for i, p in enumerate(chosen)
        ]
        results = []
        for fut in asyncio.as_completed(tasks):
            r = await fut
            results.append(r)
            if not r.ok:
                print(f"#{r.index:<3} FAILED {r.status or ''} {r.error}")
                continue
            rate = (r.output_tokens - 1) / (r.e2e - r.ttft) if r.output_tokens > 1 and r.e2e > r.ttft else 0.0
            words = " ".join(r.text.split()[:10])
            print(
                f"#{r.index:<3} TTFT {1000 * r.ttft:7.0f} ms  {r.output_tokens:4d} tok  {rate:6.1f} tok/s  "
                f"{r.finish_reason:<6} | {words}"
            )
        wall = time.monotonic() - started
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    p = lambda vals, q: percentile(vals, q) or 0.0  # noqa: E731
    print(
        f"\n{len(ok)}/{len(results)} ok in {wall:.1f} s: {tokens} tokens, {tokens / wall:.1f} tok/s overall; "
        f"TTFT p50 {1000 * p([r.ttft for r in ok], 50):.0f} ms p95 {1000 * p([r.ttft for r in ok], 95):.0f} ms; "
        f"e2e p50 {p([r.e2e for r in ok], 50):.1f} s p95 {p([r.e2e for r in ok], 95):.1f} s"
    )
    return 0 if len(ok) == len(results) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=8, help="requests to send at once (default 8)")
    ap.add_argument("--prompt", help="send this prompt n times")
    ap.add_argument("--file", help="prompts, one per line (cycled to n)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens")
    ap.add_argument("--mode", choices=["static", "continuous"], help="switch the daemon to this mode first")
    ap.add_argument("--socket", default=None, help="daemon socket (default: minibatchd's)")
    ap.add_argument("--url", default=None, help="the daemon's TCP listener instead, e.g. http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None, help="API key to send (default: $MINIBATCH_API_KEY)")
    args = ap.parse_args()
    args.socket = env_socket(args.socket)
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())

"""Draw the batch over time: which request held which batch row at each engine step.

    # replay one trace in continuous mode, then in static mode, and draw both
    .venv/bin/python scripts/timeline.py --run --out docs/bench/timeline.png
    # the step records a bench run saved (its largest sweep point, both modes)
    .venv/bin/python scripts/timeline.py --json results/bench/summary.json
    # whatever the daemon's timeline ring holds now
    .venv/bin/python scripts/timeline.py

Rows are batch rows, columns engine steps; a cell's colour is the request
that held the row, full for a decode step, pale for a prefill chunk; red
hatching is static mode's padding (a finished request's row computed anyway);
white is an empty row. Under each panel, the waiting queue per step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loadgen import env_socket, session, steps_since, stream_request, wait_mode  # noqa: E402


def trace(n: int, seed: int) -> list[dict]:
    """Chat requests with output lengths from 8 to 96 tokens: uneven, so static mode's padding shows."""
    rng = random.Random(seed)
    topics = ["the sea", "a city at night", "recursion", "prime numbers", "a sunrise", "tea", "trains", "winter"]
    return [
        {
            "messages": [{"role": "user", "content": f"Write about {rng.choice(topics)}."}],
            "max_tokens": rng.choice([8, 16, 24, 48, 64, 96]),
            "temperature": 0,
            "ignore_eos": True,
        }
        for _ in range(n)
    ]


async def replay(s, bodies: list[dict]) -> dict:
    before = (await steps_since(s, 1 << 62))["last_step"]
    results = await asyncio.gather(*(stream_request(s, i, b) for i, b in enumerate(bodies)))
    failed = [r for r in results if not r.ok]
    if failed:
        raise SystemExit(f"timeline: {len(failed)} requests failed: {failed[0].error}")
    data = await steps_since(s, before)
    data["truncated"] = bool(data["steps"]) and data["steps"][0]["step"] > before + 1
    return data


async def run_live(args) -> list[tuple[str, dict]]:
    async with session(args.socket, args.url) as s:
        async with s.get("/v1/engine/mode") as r:
            original = (await r.json())["mode"]
        panels = []
        try:
            for mode in ("continuous", "static"):
                await wait_mode(s, mode)
                panels.append((mode, await replay(s, trace(args.requests, args.seed))))
        finally:
            await wait_mode(s, original)
        return panels


async def current(args) -> list[tuple[str, dict]]:
    async with session(args.socket, args.url) as s:
        return [("the daemon's last steps", await steps_since(s, 0))]


def grid(payload: dict):
    """RGBA image [rows, steps] and the waiting counts, from step records."""
    import matplotlib
    import numpy as np

    steps = payload["steps"]
    used = max((row for r in steps for row, *_ in r["rows"]), default=-1) + 1
    img = np.ones((max(used, 1), max(len(steps), 1), 4))
    cmap = matplotlib.colormaps["tab20"]
    colour: dict[str, tuple] = {}
    padding = np.zeros(img.shape[:2], dtype=bool)
    verified: list[tuple[int, int, int]] = []  # (step, row, tokens taken)
    for x, r in enumerate(steps):
        for row, rid, _n, state, *spec in r["rows"]:
            if state == "v":  # a verifying row that took 2+ tokens: its count, drawn over the cell
                verified.append((x, row, spec[1] + 1 if len(spec) > 1 else 2))
            if rid not in colour:
                colour[rid] = cmap(len(colour) % 20)
            c = np.array(colour[rid])
            if state == "x":
                img[row, x] = (0.93, 0.42, 0.42, 1.0)
                padding[row, x] = True
            elif state == "p":
                img[row, x] = 0.45 * c + 0.55  # pale: a prefill chunk
                img[row, x, 3] = 1.0
            elif state == "e":
                img[row, x] = 0.55 * c  # dark: an embedding's prompt chunk
                img[row, x, 3] = 1.0
            elif state == "h":
                img[row, x] = 0.2 * c + 0.8
                img[row, x, 3] = 1.0
            else:
                img[row, x] = c
    waiting = [r["waiting"] for r in steps]
    return img, padding, waiting, len(colour), verified


def draw(panels: list[tuple[str, dict]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    width = max(len(p["steps"]) for _, p in panels)
    fig = plt.figure(figsize=(min(22, 4 + width / 14), 3.2 * len(panels) + 0.6))
    gs = fig.add_gridspec(2 * len(panels), 1, height_ratios=[4, 1] * len(panels), hspace=0.35)
    for i, (title, payload) in enumerate(panels):
        img, padding, waiting, n_requests, verified = grid(payload)
        ax = fig.add_subplot(gs[2 * i])
        ax.imshow(img, aspect="auto", interpolation="nearest", extent=(0, img.shape[1], img.shape[0], 0))
        ys, xs = padding.nonzero()
        for y, x in zip(ys, xs):
            ax.add_patch(plt.Rectangle((x, y), 1, 1, fill=False, hatch="////", edgecolor="white", linewidth=0))
        for x, y, taken in verified:
            ax.text(x + 0.5, y + 0.5, str(taken) if taken < 10 else "+", ha="center", va="center", fontsize=6)
        steps = payload["steps"]
        pad = sum(int(p.sum()) for p in [padding])
        busy = sum(len(r["rows"]) for r in steps)
        note = f"{len(steps)} steps, {n_requests} requests, {busy} row-steps computed"
        if pad:
            note += f", {pad} of them padding ({100 * pad / busy:.0f}%)"
        if verified:
            note += f", {len(verified)} took 2+ tokens by speculation (digits: tokens taken)"
        if payload.get("truncated"):
            note += " (ring held only the last steps)"
        ax.set_title(f"{title}: {note}", fontsize=10, loc="left")
        ax.set_ylabel("batch row")
        ax.set_xlim(0, width)
        ax.set_yticks([y + 0.5 for y in range(img.shape[0])], [str(y) for y in range(img.shape[0])])
        wax = fig.add_subplot(gs[2 * i + 1], sharex=ax)
        wax.step(range(len(waiting)), waiting, where="post", color="tab:orange")
        wax.fill_between(range(len(waiting)), waiting, step="post", alpha=0.3, color="tab:orange")
        wax.set_ylabel("waiting", fontsize=8)
        wax.set_xlabel("engine step" if i == len(panels) - 1 else "")
    fig.legend(
        handles=[
            Patch(color="tab:blue", label="decode (one colour per request)"),
            Patch(color=(0.7, 0.8, 0.9), label="prefill chunk"),
            Patch(facecolor=(0.93, 0.42, 0.42), hatch="////", edgecolor="white", label="padding (static: wasted)"),
            Patch(facecolor="white", edgecolor="grey", label="empty row"),
        ],
        loc="lower center",
        ncol=4,
        fontsize=9,
        frameon=False,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def from_json(path: Path) -> list[tuple[str, dict]]:
    data = json.loads(path.read_text())
    timeline = data.get("timeline")
    if not timeline:
        raise SystemExit(f"timeline: {path} holds no step records (bench.py saves them for its largest point)")
    return [(f"{mode} ({rec.get('point', '')})".replace(" ()", ""), rec) for mode, rec in timeline.items()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--socket", default=None, help="daemon socket (default: minibatchd's)")
    ap.add_argument("--url", default=None, help="the daemon's TCP listener instead")
    ap.add_argument("--run", action="store_true", help="replay one trace in continuous then static mode and draw both")
    ap.add_argument("--json", type=Path, default=None, help="draw the step records of a bench run (summary.json)")
    ap.add_argument("--requests", type=int, default=24, help="--run: requests in the trace")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/timeline.png"))
    args = ap.parse_args()
    args.socket = env_socket(args.socket)
    if args.json is not None:
        panels = from_json(args.json)
    else:
        panels = asyncio.run(run_live(args) if args.run else current(args))
    if args.run:
        args.out.with_suffix(".json").write_text(json.dumps({"timeline": dict(panels)}, separators=(",", ":")))
    print(f"timeline: {draw(panels, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The record's tables: written from docs/bench/record.json between markers in README.md and BENCHMARKS.md.

  .venv/bin/python scripts/tables.py            # rewrite every marked table from the committed record
  .venv/bin/python scripts/tables.py --check    # exit 1 naming each table that differs from the record

A table lives between `<!-- record:NAME -->` and `<!-- /record:NAME -->`; NAME is one of BLOCKS. A block
whose section the record lacks is left as it is (a piece that was skipped, e.g. peers without a
llama-server). `make bench` (scripts/record.py) merges a run's sections into the record, draws its plots and
calls publish() here, so a figure in those tables is always one a run printed, stamped with its date and
commit. Nobody edits them by hand: the test suite runs --check.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD = Path("docs/bench/record.json")
DOCS = ("README.md", "BENCHMARKS.md")
MARKER = re.compile(r"<!-- record:([a-z-]+) -->\n(.*?)<!-- /record:\1 -->", re.S)
PLOTS = {"modes": "record_modes.png", "variance": "record_variance.png", "rate": "record_rate.png"}


def _f(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _ms(v) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


def _ratio(a, b) -> str:
    return "-" if not a or not b else f"{a / b:.2f}×"


PEER_SECTIONS = ("peers", "prefill")  # the sections that measure llama.cpp too: their stamp names its version


def stamp(section: dict, name: str = "") -> str:
    run = section["run"]
    m = run["machine"]
    flags = ", ".join(m["flags"]) or "no AVX2"
    how = "`make bench --quick`" if run.get("quick") else "`make bench`"
    dirty = " with uncommitted changes" if run.get("dirty") else ""
    peer = run["versions"].get("llama.cpp") if name in PEER_SECTIONS else None
    return (
        f"*{how}, {run['date']}, commit `{run['commit'][:10]}`{dirty}: {m['cpu']}, {m['cores']} cores ({flags}), "
        f"{m['memory_gib']} GiB; torch {run['versions'].get('torch', '?')}"
        + (f"; llama.cpp {peer.removeprefix('version: ')}" if peer else "")
        + ".*"
    )


def modes_headline(sec: dict) -> str:
    models = sec["models"]
    head = "| c | " + " | ".join(f"{m['label']}: continuous / static tok/s | ×" for m in models) + " |"
    lines = [head, "|---:|" + "---|---:|" * len(models)]
    cs = sorted({p["c"] for m in models for p in m["points"]})
    for c in cs:
        cells = []
        for m in models:
            p = next((p for p in m["points"] if p["c"] == c), None)
            if p is None:
                cells += ["-", "-"]
                continue
            cont, stat = p["continuous"]["tok_s"], p["static"]["tok_s"]
            cells += [f"**{cont:.1f}** / {stat:.1f}" if cont >= stat else f"{cont:.1f} / **{stat:.1f}**",
                      _ratio(cont, stat)]  # fmt: skip
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def modes_detail(sec: dict) -> str:
    slo = sec["slo"]
    out = [
        f"{sec['trace']}. Goodput: requests per second that met TTFT ≤ {slo['ttft_s']:g} s and TPOT ≤ "
        f"{1000 * slo['tpot_s']:.0f} ms."
    ]
    for m in sec["models"]:
        out += [
            "",
            f"**{m['label']}** ({_f(m.get('file_mb'), 0)} MB):",
            "",
            "| c | requests × runs | mode | tok/s | continuous / static | TTFT p50 / p95 / p99 (ms) "
            "| TPOT p50 / p95 (ms) | e2e p50 / p95 / p99 (s) | goodput (req/s) | wasted row-steps |",
            "|---:|---:|---|---:|---:|---|---|---|---:|---:|",
        ]
        for p in m["points"]:
            for mode in ("continuous", "static"):
                x = p[mode]
                ratio = _ratio(p["continuous"]["tok_s"], p["static"]["tok_s"]) if mode == "continuous" else ""
                out.append(
                    f"| {p['c']} | {p['requests']} × {p['repeats']} | {mode} | {x['tok_s']:.1f} | {ratio} | "
                    + " / ".join(_ms(x["ttft"][q]) for q in ("p50", "p95", "p99"))
                    + " | "
                    + " / ".join(_ms(x["tpot"][q]) for q in ("p50", "p95"))
                    + " | "
                    + " / ".join(_f(x["e2e"][q]) for q in ("p50", "p95", "p99"))
                    + f" | {x['goodput']:.2f} | {x['wasted_row_steps']} |"
                )
    return "\n".join(out)


def sweep(sec: dict, xname: str) -> str:
    lines = [
        f"| {xname} | tok/s continuous / static | × | TTFT p95 (s) | e2e p95 (s) | goodput (req/s) "
        "| wasted row-steps (static) |",
        "|---|---|---:|---|---|---|---:|",
    ]
    for p in sec["points"]:
        c, s = p["continuous"], p["static"]
        lines.append(
            f"| {p['point']} | {c['tok_s']:.1f} / {s['tok_s']:.1f} | {_ratio(c['tok_s'], s['tok_s'])} | "
            f"{_f(c['ttft']['p95'], 2)} / {_f(s['ttft']['p95'], 2)} | {_f(c['e2e']['p95'])} / {_f(s['e2e']['p95'])} | "
            f"{c['goodput']:.2f} / {s['goodput']:.2f} | {s['wasted_row_steps']} |"
        )
    return "\n".join(lines)


def serving(sec: dict, prefill: dict | None) -> str:
    pre = {r["key"]: r for r in (prefill or {}).get("rows", [])}
    lines = [
        "| model | file | weights | start to ready | RSS after serving | KV pool | prefill of one prompt "
        "| llama-bench, the same prompt length |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in sec["rows"]:
        p = pre.get(r["key"], {})
        lines.append(
            f"| {r['label']} | {_f(r.get('file_mb'), 0)} MB | {r.get('weights') or '-'} | {r['start_s']:.1f} s | "
            f"{r['rss_after_mb']:.0f} MB | {r['kv_cache_mb']} MB | "
            f"{_f(p.get('tok_s'), 0)} tok/s ({p.get('tokens', '-')} tokens) | "
            f"{_f(p.get('llama_bench_tok_s'), 0)}{' tok/s' if p.get('llama_bench_tok_s') else ''} |"
        )
    return "\n".join(lines)


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def spec(sec: dict) -> str:
    lines = [
        "| workload | c | tok/s off / ngram | × | TPOT p50 off / ngram (ms) | TPOT p95 off / ngram (ms) "
        "| accepted / drafted | acceptance | texts differing |",
        "|---|---:|---|---:|---|---|---:|---:|---:|",
    ]
    rows = sec["rows"]
    for r in rows:
        if r["variant"] != "ngram":
            continue
        off = next(
            o
            for o in rows
            if o["variant"] == "off" and (o["workload"], o["concurrency"]) == (r["workload"], r["concurrency"])
        )
        lines.append(
            f"| {r['workload']} | {r['concurrency']} | {off['tokens_per_s']:.1f} / {r['tokens_per_s']:.1f} | "
            f"{_ratio(r['tokens_per_s'], off['tokens_per_s'])} | {off['tpot_p50_ms']:.1f} / {r['tpot_p50_ms']:.1f} | "
            f"{off['tpot_p95_ms']:.1f} / {r['tpot_p95_ms']:.1f} | "
            f"{r['accepted_tokens']:.0f} / {r['draft_tokens']:.0f} | "
            f"{_percent(r['accepted_tokens'], r['draft_tokens'])} | {r.get('texts_differing', '-')} |"
        )
    return "\n".join(lines)


def cluster(sec: dict) -> str:
    lines = [
        "| setup | turns | output tok/s | TTFT p50 / p95 (ms) | prefix-cache hit rate |",
        "|---|---:|---:|---|---:|",
    ]
    for r in sec["setups"]:
        lines.append(
            f"| {r['setup']} | {r['turns']} | {r['output_tok_s']:.1f} | {r['ttft_p50_ms']:.0f} / "
            f"{r['ttft_p95_ms']:.0f} | {100 * r['prefix_hit_rate']:.1f}% |"
        )
    one = [r["one_token"] for r in sec["setups"] if "one_token" in r]
    if one:
        o = one[0]
        lines += [
            "",
            f"A 1-token request through the ingress: p50 {o['ingress_p50_ms']:.1f} ms, p99 "
            f"{o['ingress_p99_ms']:.1f} ms; straight to the replica p50 {o['direct_p50_ms']:.1f} ms, p99 "
            f"{o['direct_p99_ms']:.1f} ms: the ingress adds {o['added_p50_ms']:.1f} ms (p50), "
            f"{o['added_p99_ms']:.1f} ms (p99).",
        ]
    k = sec.get("key_cost")
    if k:
        lines.append(
            f"The routing key of a request: {k['hash_us']:.0f} µs to hash its text blocks, against "
            f"{k['tokenize_us']:.0f} µs to render its chat template and tokenize ({k['requests']} requests)."
        )
    return "\n".join(lines)


def peers(sec: dict) -> str:
    """Per model: each server's tokens/s by concurrency and ours over the best llama.cpp's; where the record
    has sampled runs beside greedy ones (rows carry `sampling`), a column group for each."""
    out = []
    for m in sec["models"]:
        servers = list(dict.fromkeys(r["server"] for r in m["rows"]))
        modes = list(dict.fromkeys(r.get("sampling", "greedy") for r in m["rows"]))
        named = len(modes) > 1 or modes != ["greedy"]
        head = ["| c |"]
        for mode in modes:
            tag = f" ({mode})" if named else ""
            head.append(" " + " | ".join(f"{s} tok/s{tag}" for s in servers) + f" | minibatch / best llama.cpp{tag} |")
        out += ["", f"**{m['label']}**:", "", "".join(head)]
        out.append("|---:|" + "---:|" * ((len(servers) + 1) * len(modes)))
        for c in sorted({r["c"] for r in m["rows"]}):
            cells = [f"| {c} |"]
            for mode in modes:
                at = {r["server"]: r["tok_s"] for r in m["rows"] if r["c"] == c and r.get("sampling", "greedy") == mode}
                best = max((v for k, v in at.items() if k.startswith("llama.cpp")), default=None)
                ours = next((v for k, v in at.items() if k.startswith("minibatch")), None)
                cells.append(" " + " | ".join(_f(at.get(s)) for s in servers) + f" | {_ratio(ours, best)} |")
            out.append("".join(cells))
    return "\n".join(out[1:])


def sources(record: dict) -> str:
    lines = ["| section | measured | commit | quick | machine |", "|---|---|---|---|---|"]
    for name, sec in sorted(record["sections"].items()):
        run = sec["run"]
        lines.append(
            f"| {name} | {run['date']} | `{run['commit'][:10]}` | {'yes' if run.get('quick') else 'no'} | "
            f"{run['machine']['cpu']}, {run['machine']['cores']} cores |"
        )
    return "\n".join(lines)


# block name -> (sections it needs, renderer)
BLOCKS = {
    "modes-headline": (("modes",), lambda r: modes_headline(r["sections"]["modes"])),
    "modes": (("modes",), lambda r: modes_detail(r["sections"]["modes"])),
    "variance": (("variance",), lambda r: sweep(r["sections"]["variance"], "output-length sd")),
    "rate": (("rate",), lambda r: sweep(r["sections"]["rate"], "request rate")),
    "serving": (("serving",), lambda r: serving(r["sections"]["serving"], r["sections"].get("prefill"))),
    "spec": (("spec",), lambda r: spec(r["sections"]["spec"])),
    "cluster": (("cluster",), lambda r: cluster(r["sections"]["cluster"])),
    "peers": (("peers",), lambda r: peers(r["sections"]["peers"])),
    "sources": ((), sources),
}


ALSO = {"serving": ("prefill",)}  # a block's columns from another section, which may come from another run


def heading(record: dict, names: tuple[str, ...]) -> str:
    """The stamp of the runs behind a block: one line when one run measured all its sections, else one per section."""
    secs = [(n, record["sections"][n]) for n in names if n in record["sections"]]
    stamps = {n: stamp(sec, n) for n, sec in secs}
    if len({stamp(sec) for _, sec in secs}) <= 1:  # one run: its stamp, naming llama.cpp where a section measured it
        return next((line for n, line in stamps.items() if n in PEER_SECTIONS), next(iter(stamps.values()), ""))
    return "  \n".join(f"{n}: {line}" for n, line in stamps.items())


def render(record: dict) -> dict[str, str]:
    """Every block whose sections the record has, under the stamp of the run(s) that measured them."""
    out = {}
    for name, (needs, draw) in BLOCKS.items():
        if all(n in record["sections"] for n in needs):
            head = heading(record, (*needs, *ALSO.get(name, ()))) + "\n\n" if needs else ""
            out[name] = head + draw(record).strip() + "\n"
    return out


def rewrite(text: str, blocks: dict[str, str]) -> tuple[str, list[str]]:
    """The text with each marked block replaced; the names of those that changed."""
    changed = []

    def sub(m: re.Match) -> str:
        name, old = m.group(1), m.group(2)
        if name not in BLOCKS:
            raise SystemExit(f"tables: unknown block <!-- record:{name} -->; known: {', '.join(BLOCKS)}")
        new = blocks.get(name, old)
        if new != old:
            changed.append(name)
        return f"<!-- record:{name} -->\n{new}<!-- /record:{name} -->"

    return MARKER.sub(sub, text), changed


def merge(record: dict, run: dict) -> dict:
    """A run's sections replace the record's same-named ones; the others stay with their own stamps."""
    return {"sections": {**record.get("sections", {}), **run["sections"]}, "notes": run.get("notes", [])}


def plots(record: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    secs = record["sections"]
    if "modes" in secs:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for m, color in zip(secs["modes"]["models"], ("tab:blue", "tab:green", "tab:purple")):
            xs = [p["c"] for p in m["points"]]
            for mode, style in (("continuous", "o-"), ("static", "s--")):
                axes[0].plot(
                    xs, [p[mode]["tok_s"] for p in m["points"]], style, color=color, label=f"{m['label']}, {mode}"
                )
                axes[1].plot(
                    xs, [p[mode]["e2e"]["p95"] for p in m["points"]], style, color=color, label=f"{m['label']}, {mode}"
                )
        for ax, ylabel in zip(axes, ("output tokens/s", "end-to-end latency p95 (s)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        made.append(out / PLOTS["modes"])
        fig.savefig(made[-1], dpi=110)
        plt.close(fig)
    for name, key, xlabel in (
        ("variance", "tok_s", "output-length standard deviation (tokens)"),
        ("rate", "ttft", "request rate (req/s)"),
    ):
        if name not in secs:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4))
        pts = secs[name]["points"]
        xs = [p["x"] for p in pts]
        for mode, style in (("continuous", "o-"), ("static", "s--")):
            ys = [p[mode]["tok_s"] if key == "tok_s" else p[mode]["ttft"]["p95"] for p in pts]
            ax.plot(xs, ys, style, label=mode)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("output tokens/s" if key == "tok_s" else "TTFT p95 (s)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        made.append(out / PLOTS[name])
        fig.savefig(made[-1], dpi=110)
        plt.close(fig)
    return made


def publish(run_path: Path, root: Path = ROOT) -> list[str]:
    """Merge a run's record into the committed one, copy its plots beside it, rewrite the docs' tables."""
    run = json.loads(run_path.read_text())
    target = root / RECORD
    record = merge(json.loads(target.read_text()) if target.exists() else {}, run)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(record, indent=1) + "\n")
    lines = [f"record: {target} ({', '.join(sorted(run['sections']))} from this run)"]
    for name, fname in PLOTS.items():
        if name in run["sections"] and (run_path.parent / fname).exists():
            shutil.copy(run_path.parent / fname, target.parent / fname)
            lines.append(f"plot: {target.parent / fname}")
    return lines + write_docs(record, root)


def write_docs(record: dict, root: Path, check: bool = False) -> list[str]:
    blocks = render(record)
    lines = []
    for doc in DOCS:
        path = root / doc
        text = path.read_text()
        new, changed = rewrite(text, blocks)
        if changed:
            lines.append(f"{doc}: {'differs from the record' if check else 'rewrote'}: {', '.join(changed)}")
            if not check:
                path.write_text(new)
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table differs from the record")
    ap.add_argument("--root", type=Path, default=ROOT)
    args = ap.parse_args()
    record = json.loads((args.root / RECORD).read_text())
    lines = write_docs(record, args.root, check=args.check)
    for line in lines:
        print(f"tables: {line}")
    return 1 if args.check and lines else 0


if __name__ == "__main__":
    sys.exit(main())

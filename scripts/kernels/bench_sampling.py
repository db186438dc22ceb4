"""What sampling costs: the sampler's own time per row, and the engine's tokens/s sampled beside greedy.

  .venv/bin/python scripts/kernels/bench_sampling.py                              # both parts
  .venv/bin/python scripts/kernels/bench_sampling.py --part sampler       # per-row cost by vocabulary and setting
  .venv/bin/python scripts/kernels/bench_sampling.py --part engine --concurrency 1,4,16,64 --repeats 3

sampler: `Sampler.__call__` on the built-in model's own next-token logits (captured while it answers chat
prompts; 49,152 tokens), on those logits spread over 151,936 tokens (Qwen2.5's and Qwen3's vocabulary: the
real rows and two copies shifted down with noise, a longer tail), and on random-normal logits (a
random-weight model's flat rows); 1 and 16 rows a call, each setting the median of --calls calls.

engine: the built-in model (or --model: a GGUF of another vocabulary, e.g. make_model.py's Qwen2.5 shape
with --true-vocab) in this process, speculation off and at its default; every concurrency runs
that many chat prompts at once with outputs forced to --tokens (ignore_eos), greedy, the chat's defaults
(temperature 0.7, top_p 0.95) and Ollama's (0.8, top_k 40, top_p 0.9) one after another in each round,
so the ratios compare runs measured side by side; tokens/s is the median over --repeats rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import CHAT_SET  # noqa: E402

from minibatch.engine.core.request import Request  # noqa: E402
from minibatch.engine.core.sampling_params import SamplingParams  # noqa: E402
from minibatch.engine.factory import EngineConfig, build_engine  # noqa: E402
from minibatch.engine.runner.sampler import Sampler  # noqa: E402
from minibatch.engine.store.cache import DEFAULT_MODEL  # noqa: E402

# name -> SamplingParams fields: the settings the sampler table reports
SETTINGS = {
    "greedy": dict(temperature=0),
    "temperature 0.7": dict(temperature=0.7),
    "top_k 40": dict(temperature=0.7, top_k=40),
    "top_p 0.95": dict(temperature=0.7, top_p=0.95),
    "min_p 0.05": dict(temperature=0.7, min_p=0.05),
    "chat (0.7 / top_p 0.95)": dict(temperature=0.7, top_p=0.95),
    "Ollama (0.8 / top_k 40 / top_p 0.9)": dict(temperature=0.8, top_k=40, top_p=0.9),
    "chat + penalties": dict(temperature=0.7, top_p=0.95, repetition_penalty=1.1, frequency_penalty=0.5),
    "chat, seeded": dict(temperature=0.7, top_p=0.95, seed=7),
    # llama-server's samplers (engine/runner/chain.py, DRY in engine/runner/dry.py) beside the fused pass's
    "chat + typical_p 0.9": dict(temperature=0.7, top_p=0.95, typical_p=0.9),
    "chat + top_n_sigma 1.0": dict(temperature=0.7, top_p=0.95, top_n_sigma=1.0),
    "chat + XTC (0.5, 0.1)": dict(temperature=0.7, top_p=0.95, xtc_probability=0.5),
    "chat + DRY 0.8": dict(temperature=0.7, top_p=0.95, dry_multiplier=0.8),
    "Mirostat 2 (tau 5, eta 0.1)": dict(temperature=0.7, mirostat=2),
}
# the engine part's workloads: greedy beside the two sampling defaults people meet
WORKLOADS = {
    "greedy": dict(temperature=0),
    "chat": dict(temperature=0.7, top_p=0.95),
    "ollama": dict(temperature=0.8, top_k=40, top_p=0.9),
}
QWEN_VOCAB = 151936


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    rows = [json.loads(line)["prompt"] for line in CHAT_SET.read_text().splitlines() if line.strip()]
    return [tokenizer.chat([{"role": "user", "content": rows[i % len(rows)]}]) for i in range(n)]


class Recorder:
    """Stands in for the runner's sampler while the model answers: keeps each row of logits it is given."""

    def __init__(self, sampler: Sampler, limit: int) -> None:
        self.sampler, self.limit, self.rows = sampler, limit, []

    def __call__(self, logits, reqs, positions=None):
        if len(self.rows) < self.limit:
            self.rows.extend(logits.float().clone().unbind(0))
        return self.sampler(logits, reqs, positions)

    def __getattr__(self, name):
        return getattr(self.sampler, name)


def real_logits(engine, prompts: list[list[int]], rows: int) -> torch.Tensor:
    runner = engine.runner
    recorder = Recorder(runner.sampler, rows)
    runner.sampler = recorder
    try:
        for i, p in enumerate(prompts):
            engine.add_request(f"cap{i}", p, SamplingParams(temperature=0.7, top_p=0.95, max_tokens=48, seed=i))
        while engine.has_work():
            engine.step()
    finally:
        runner.sampler = recorder.sampler
    return torch.stack(recorder.rows[:rows])


def spread(logits: torch.Tensor, vocab: int, seed: int = 0) -> torch.Tensor:
    """Real rows over a larger vocabulary: the row, then copies shifted 4, 6, 8, ... nats down with noise."""
    g = torch.Generator().manual_seed(seed)
    parts, shift = [logits], 4.0
    while sum(p.shape[1] for p in parts) < vocab:
        parts.append(logits - shift + torch.randn(logits.shape, generator=g))
        shift += 2.0
    return torch.cat(parts, dim=1)[:, :vocab].contiguous()


def time_sampler(sampler: Sampler, logits: torch.Tensor, params: dict, rows: int, calls: int) -> float:
    """Median seconds per row of `calls` calls, each on `rows` rows (a request per row, 300 output tokens)."""
    reqs = []
    for i in range(rows):
        r = Request(f"t{i}", list(range(100, 150)), SamplingParams(**params))
        r.output_token_ids = [(7 * j + i) % 4000 for j in range(300)]
        reqs.append(r)
    times = []
    for c in range(calls + 3):
        batch = logits[[(c * rows + i) % logits.shape[0] for i in range(rows)]].clone()
        t0 = time.perf_counter()
        sampler(batch, reqs)
        if c >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) / rows


def sampler_part(engine, args) -> list[dict]:
    prompts = chat_prompts(engine.tokenizer, 8)
    real = real_logits(engine, prompts, 64)
    g = torch.Generator().manual_seed(1)
    shapes = {
        "built-in model, 49,152": real,
        "its rows spread over 151,936": spread(real, QWEN_VOCAB),
        "random-normal, 151,936": torch.randn(64, QWEN_VOCAB, generator=g),
    }
    sampler = Sampler(ops=engine.runner.model.ops, token_texts=engine.tokenizer.token_texts)  # DRY's breakers
    out = []
    for shape, logits in shapes.items():
        for name, params in SETTINGS.items():
            for rows in (1, 16):
                ms = time_sampler(sampler, logits, params, rows, args.calls) * 1e3
                out.append({"logits": shape, "setting": name, "rows": rows, "ms_per_row": ms})
                print(f"  {shape:30s} {name:38s} rows {rows:2d}: {ms:.3f} ms/row", flush=True)
    return out


def run_once(engine, prompts: list[list[int]], params: dict, tokens: int, tag: str) -> float:
    reqs = [
        engine.add_request(f"{tag}-{i}", p, SamplingParams(**params, max_tokens=tokens, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
    wall = time.perf_counter() - t0
    assert all(len(r.output_token_ids) == tokens for r in reqs)
    return len(reqs) * tokens / wall


def engine_part(args) -> list[dict]:
    out = []
    for spec in args.spec.split(","):
        engine = build_engine(EngineConfig(model=args.model, speculative=spec, max_num_seqs=max(args.concurrency)))
        prompts = chat_prompts(engine.tokenizer, max(args.concurrency))
        run_once(engine, prompts[:2], WORKLOADS["chat"], 16, "warm")
        for c in args.concurrency:
            got: dict[str, list[float]] = {w: [] for w in WORKLOADS}
            for rnd in range(args.repeats):
                for w, params in WORKLOADS.items():
                    got[w].append(run_once(engine, prompts[:c], params, args.tokens, f"{spec}-{c}-{w}-{rnd}"))
            row = {"speculative": spec, "concurrency": c, **{w: statistics.median(v) for w, v in got.items()}}
            row["runs"] = got
            out.append(row)
            ratio = {w: row[w] / row["greedy"] for w in WORKLOADS}
            print(
                f"  spec {spec:5s} c={c:2d}: greedy {row['greedy']:.1f} tok/s, chat {row['chat']:.1f} "
                f"({ratio['chat']:.2f}x), ollama {row['ollama']:.1f} ({ratio['ollama']:.2f}x)",
                flush=True,
            )
        del engine
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["sampler", "engine", "both"], default="both")
    ap.add_argument("--calls", type=int, default=40, help="sampler: calls per setting (median)")
    ap.add_argument("--concurrency", type=lambda v: [int(x) for x in v.split(",")], default=[1, 4, 16, 64])
    ap.add_argument("--tokens", type=int, default=128, help="engine: output tokens per request (forced)")
    ap.add_argument("--repeats", type=int, default=3, help="engine: rounds (median)")
    ap.add_argument("--spec", default="off,ngram", help="engine: speculation settings, comma-separated")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="engine: the model (a name, a directory or a GGUF file)")
    ap.add_argument("--json", default="results/bench_sampling.json")
    args = ap.parse_args()
    report: dict = {"torch_threads": torch.get_num_threads(), "model": args.model}
    if args.part in ("sampler", "both"):
        print("sampler, per row:", flush=True)
        report["sampler"] = sampler_part(build_engine(EngineConfig(speculative="off")), args)
    if args.part in ("engine", "both"):
        print("engine, output tokens/s:", flush=True)
        report["engine"] = engine_part(args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

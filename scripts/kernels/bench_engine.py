"""In-process engine benchmark: continuous vs static batching vs Hugging Face, on one trace.

All variants run in this one process, one after another, on the same seeded
trace (prompt and output lengths drawn once; outputs forced to their length
with ignore_eos so every variant does the same work), and each is repeated
--repeats times; the tables report the median. All requests are queued at
t=0, so end-to-end latency is completion time.

Variants:
  continuous   minibatch, iteration-level batching (max --max-running at once)
  static       minibatch's static mode (request-level batches of --max-running)
  hf-static    transformers `generate`, left-padded batches of --max-running in
               arrival order; a batch runs until its longest member is done
  hf-cb        transformers' own continuous batching manager, if it runs here
Also: batch-1 decode tokens/s (ours vs HF generate), and engine efficiency =
time of the model's linear layers alone for a 64-row decode batch / our full
decode step time with 64 requests running.

Run: .venv/bin/python scripts/kernels/bench_engine.py [--quick] [--json results/bench_engine.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from minibatch.engine.core.sampling_params import SamplingParams
from minibatch.engine.factory import EngineConfig, build_engine

MAX_BATCHED_TOKENS = 1024  # a step's token budget, ours and transformers' manager's


def make_trace(n, pmin, pmax, omin, omax, seed, vocab=(200, 40000)):
    rng = random.Random(seed)
    return [
        ([rng.randrange(*vocab) for _ in range(rng.randint(pmin, pmax))], rng.randint(omin, omax)) for _ in range(n)
    ]


def summarize(name, wall, e2e, out_tokens):
    e2e = sorted(e2e)
    return {
        "variant": name,
        "wall_s": wall,
        "output_tok_s": out_tokens / wall,
        "p50_e2e_s": statistics.median(e2e),
        "p95_e2e_s": e2e[min(len(e2e) - 1, int(round(0.95 * (len(e2e) - 1))))],
    }


def run_ours(engine, trace, mode):
    engine.set_mode(mode)
    while engine.has_work() or engine.mode != mode:
        engine.step()
    t0 = engine.clock()
    reqs = [
        engine.add_request(
            f"{mode}-{i}-{time.monotonic_ns()}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        )
        for i, (p, n) in enumerate(trace)
    ]
    while engine.has_work():
        engine.step()
    wall = engine.clock() - t0
    assert all(len(r.output_token_ids) == n for r, (_, n) in zip(reqs, trace))
    return summarize(mode, wall, [r.finished_time - t0 for r in reqs], sum(n for _, n in trace)), engine


def run_hf_static(hf, trace, batch):
    t0 = time.monotonic()
    e2e = []
    for start in range(0, len(trace), batch):
        group = trace[start : start + batch]
        width = max(len(p) for p, _ in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group])
        with torch.no_grad():
            hf.generate(
                ids, attention_mask=mask, do_sample=False, max_new_tokens=max(n for _, n in group), pad_token_id=0
            )
        done = time.monotonic() - t0
        e2e += [done] * len(group)
    return summarize("hf-static", time.monotonic() - t0, e2e, sum(n for _, n in trace))


def run_hf_cb(hf, trace, batch):
    """transformers' manager with a cache for `batch` of the trace's longest requests and our batch's token
    budget (left to itself on a CPU it sizes both from the memory it finds), timed from its first request:
    its warm-up runs before."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cfg = GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in trace), eos_token_id=None, pad_token_id=0)
    page = 256
    longest = max(len(p) + n for p, n in trace)
    cb = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=batch * -(-longest // page) + 1,
        max_batch_tokens=MAX_BATCHED_TOKENS,
        max_requests_per_batch=batch,
    )
    e2e = {}
    with hf.continuous_batching_context_manager(
        generation_config=cfg, block=True, timeout=5, continuous_batching_config=cb
    ) as manager:
        t0 = time.monotonic()
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in trace]
        while len(e2e) < len(ids):
            res = manager.get_result(timeout=60)
            if res is None:
                raise RuntimeError("transformers' manager returned no result within 60 s")
            if res.is_finished():
                e2e[res.request_id] = time.monotonic() - t0
    return summarize("hf-cb", time.monotonic() - t0, list(e2e.values()), sum(n for _, n in trace))


def batch1_decode(engine, hf, prompt, n):
    r = engine.add_request(
        f"b1-{time.monotonic_ns()}", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    )
    while engine.has_work():
        engine.step()
    ours = (n - 1) / (r.token_times[-1] - r.first_token_time)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        t0 = time.perf_counter()
        hf.generate(ids, do_sample=False, max_new_tokens=1, pad_token_id=0)
        t1 = time.perf_counter()
        hf.generate(ids, do_sample=False, max_new_tokens=n, pad_token_id=0)
        t2 = time.perf_counter()
    return ours, (n - 1) / ((t2 - t1) - (t1 - t0))


@torch.inference_mode()
def efficiency(engine, rows=64, context=192, steps=8):
    """The model's matmuls alone for `rows` tokens vs our decode step with `rows` requests of ~`context` tokens.

    The matmuls are the ones the forward runs, in the form it runs them (quantized blocks, packed fp32...),
    as the model lists them; what they stream per step is the engine's own account (EngineInfo.memory)."""
    model = engine.runner.model
    rng = random.Random(1)
    for i in range(rows):
        engine.add_request(
            f"eff-{i}",
            [rng.randrange(200, 40000) for _ in range(context)],
            SamplingParams(temperature=0, max_tokens=steps + 40, ignore_eos=True),
        )
    decode_times = []
    while engine.has_work() and len(decode_times) < steps:
        _, st = engine.step()
        if st is not None and st.decode_tokens == rows and st.prefill_tokens == 0:
            decode_times.append(st.step_time)
    for i in range(rows):
        engine.abort(f"eff-{i}")
    while engine.has_work():
        engine.step()
    layers = [m for _, m in model.projections()][:-1]  # the output projection runs through compute_logits
    x = {m: torch.randn(rows, m.in_features) for m in layers}
    h = torch.randn(rows, model.config.hidden_size)
    lin_times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for m in layers:
            m(x[m])
        model.compute_logits(h)
        lin_times.append(time.perf_counter() - t0)
    step, lin = statistics.median(decode_times), statistics.median(lin_times)
    streamed = engine.info.memory.matmul_bytes_per_step
    return {
        "rows": rows,
        "context": context,
        "decode_step_ms": step * 1e3,
        "linears_ms": lin * 1e3,
        "efficiency": lin / step,
        "matmul_bytes_per_step": streamed,
        "matmul_read_gb_s": streamed / lin / 1e9,
        "matmuls": len(layers) + 1,
        "weights": engine.info.weights,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prompt", default="32,256", help="min,max prompt tokens")
    ap.add_argument("--output", default="16,256", help="min,max output tokens")
    ap.add_argument("--max-running", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf-repeats", type=int, default=None, help="repeats for the HF variants (default: --repeats)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default="continuous,static,hf-static,hf-cb")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="16 requests, short lengths, 1 repeat, efficiency at 16 rows (flags given override these)",
    )
    ap.add_argument("--json", type=Path, default=None)
    quick = {"requests": 16, "prompt": "16,64", "output": "8,48", "repeats": 1, "max_running": 8}
    if "--quick" in sys.argv[1:]:  # its sizes, under what the command line sets itself
        ap.set_defaults(**quick)
    args = ap.parse_args()
    pmin, pmax = map(int, args.prompt.split(","))
    omin, omax = map(int, args.output.split(","))
    trace = make_trace(args.requests, pmin, pmax, omin, omax, args.seed)
    variants = args.variants.split(",")
    print(
        f"trace: {len(trace)} requests, prompts {pmin}-{pmax}, outputs {omin}-{omax} "
        f"({sum(n for _, n in trace)} output tokens), max running {args.max_running}, "
        f"threads {torch.get_num_threads()}",
        file=sys.stderr,
    )

    # Prefix caching off: replaying one trace would otherwise hit the previous run's cached prompts,
    # a head start the HF baseline does not get.
    engine = build_engine(
        EngineConfig(
            model=args.model,
            max_num_seqs=max(64, args.max_running),
            max_num_batched_tokens=MAX_BATCHED_TOKENS,
            kv_cache_gb=3.0,
            max_wait_ms=0,
            enable_prefix_caching=False,
        )
    )
    engine.scheduler.config.max_num_seqs = args.max_running

    from minibatch.engine.weights.reference import load_hf_reference

    hf = load_hf_reference(engine.info.model_dir)
    hf.generation_config.eos_token_id = None
    results: dict[str, list[dict]] = {v: [] for v in variants}
    errors = {}
    hf_repeats = args.repeats if args.hf_repeats is None else args.hf_repeats
    for rep in range(args.repeats):
        for v in variants:
            if v.startswith("hf") and rep >= hf_repeats:
                continue
            try:
                if v in ("continuous", "static"):
                    res, _ = run_ours(engine, trace, v)
                elif v == "hf-static":
                    res = run_hf_static(hf, trace, args.max_running)
                else:
                    res = run_hf_cb(hf, trace, args.max_running)
            except Exception as exc:  # report, keep measuring the rest
                errors[v] = f"{type(exc).__name__}: {exc}"
                print(f"  {v}: failed: {errors[v]}", file=sys.stderr)
                variants = [x for x in variants if x != v]
                continue
            results[v].append(res)
            print(
                f"  rep {rep + 1} {v:<11} {res['output_tok_s']:7.1f} tok/s  "
                f"p50 {res['p50_e2e_s']:6.1f} s  p95 {res['p95_e2e_s']:6.1f} s",
                file=sys.stderr,
            )

    engine.set_mode("continuous")
    while engine.has_work():
        engine.step()
    engine.scheduler.config.max_num_seqs = 64
    b1 = [batch1_decode(engine, hf, trace[0][0][:64], 64 if args.quick else 128) for _ in range(args.repeats)]
    eff = efficiency(engine, rows=16 if args.quick else 64, context=64 if args.quick else 192)

    med = {
        v: {k: statistics.median(r[k] for r in rs) for k in ("output_tok_s", "p50_e2e_s", "p95_e2e_s")}
        for v, rs in results.items()
        if rs
    }
    print("\n| variant | runs | output tok/s | p50 e2e (s) | p95 e2e (s) |\n|---|---:|---:|---:|---:|")
    for v, m in med.items():
        print(f"| {v} | {len(results[v])} | {m['output_tok_s']:.1f} | {m['p50_e2e_s']:.1f} | {m['p95_e2e_s']:.1f} |")
    for v, e in errors.items():
        print(f"| {v} | failed: {e} | | |")
    ours_b1 = statistics.median(b for b, _ in b1)
    hf_b1 = statistics.median(h for _, h in b1)
    print(
        f"\nbatch-1 decode: minibatch {ours_b1:.1f} tok/s, HF generate {hf_b1:.1f} tok/s, ratio {ours_b1 / hf_b1:.2f}"
    )
    print(
        f"engine efficiency at {eff['rows']} running (context ~{eff['context']}), {eff['weights']}: "
        f"{eff['matmuls']} matmuls {eff['linears_ms']:.0f} ms / decode step {eff['decode_step_ms']:.0f} ms "
        f"= {eff['efficiency']:.2f}; "
        f"the matmuls read {eff['matmul_bytes_per_step'] / 1e6:.0f} MB of weights per step "
        f"({eff['matmul_read_gb_s']:.1f} GB/s)"
    )
    if "continuous" in med:
        for other in ("static", "hf-static", "hf-cb"):
            if other in med:
                print(
                    f"continuous / {other}: "
                    f"throughput x{med['continuous']['output_tok_s'] / med[other]['output_tok_s']:.2f}, "
                    f"p95 e2e x{med['continuous']['p95_e2e_s'] / med[other]['p95_e2e_s']:.2f}"
                )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"json": str(args.json)},
                    "runs": results,
                    "median": med,
                    "errors": errors,
                    "batch1": b1,
                    "efficiency": eff,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()

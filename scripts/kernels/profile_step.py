"""Where one engine step spends its time: a batch-1 and a batch-64 decode step, in-process.

  .venv/bin/python scripts/kernels/profile_step.py [--model M] [--weights native|float32] [--rows 1,64]
      [--context 200] [--sampling chat]

For each batch size it fills the engine with that many requests of --context
prompt tokens (greedy, or --sampling chat / ollama: the benchmarks' presets),
lets them reach decode, then times --steps decode steps: the whole step
(schedule, forward, sample, update, detokenize) and, with wrappers around each
part's entry point, the time of the matmuls (and below it each kind of matrix
with its storage type: q/k/v, o, gate/up, down, the output head), the
attention, the small ops, the sampler, the scheduler and the rest.

With --prefill N it times instead the step that prefills one N-token prompt
whole (median of --steps after a warm-up), as llama-bench's ppN measures, and
where that step's time goes.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from benchlib import sampling_presets  # noqa: E402  (scripts/: the benchmarks' sampling presets)

from minibatch.engine.core.sampling_params import SamplingParams  # noqa: E402
from minibatch.engine.factory import EngineConfig, build_engine  # noqa: E402

BY_KIND = "matmul: "  # the per-kind parts' prefix (they are within "matmul")


class Timers:
    """Wall time per part of the step, from wrappers around the parts' entry points."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = defaultdict(float)

    def wrap(self, owner, attr: str, group: str) -> None:
        inner = getattr(owner, attr)
        ms = self.ms

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                ms[group] += (time.perf_counter() - t) * 1e3

        if not inspect.isroutine(inner):
            # a callable object (the sampler): keep its other attributes reachable
            timed = type(
                "Timed", (), {"__call__": staticmethod(timed), "__getattr__": lambda _, n: getattr(inner, n)}
            )()
        setattr(owner, attr, timed)


def instrument(engine) -> Timers:
    from minibatch.engine.weights.cpu_linear import PackedLinear
    from minibatch.engine.weights.quant_linear import QuantEmbedding, QuantLinear

    timers = Timers()
    for cls, group in ((QuantLinear, "matmul"), (PackedLinear, "matmul"), (QuantEmbedding, "embedding")):
        timers.wrap(cls, "forward", group)
    timers.wrap(torch.nn.Linear, "forward", "matmul")
    # and each matrix by its kind and storage type (every layer's q/k/v, o, gate/up, down; the output head)
    for name, module in engine.runner.model.named_modules():
        if isinstance(module, (QuantLinear, PackedLinear, torch.nn.Linear)):
            kind = next(p for p in reversed(name.split(".")) if p != "parts" and not p.isdigit())
            qtype = getattr(module, "qtype", None)  # a float matrix (torch.nn.Linear) has none
            timers.wrap(module, "forward", f"{BY_KIND}{kind} {qtype.name if qtype else 'float'}")
    runner = engine.runner
    timers.wrap(runner.model.backend, "forward", "attention (+KV store)")
    timers.wrap(runner.model.backend, "prepare", "attention plan")
    ops = runner.model.ops
    for name in ("rms_norm", "add_rms_norm", "rotary", "silu_mul"):
        timers.wrap(ops, name, "norms, rotary, SiLU")
    timers.wrap(runner, "sampler", "sampler")
    timers.wrap(runner, "execute", "runner (all of the above)")
    timers.wrap(engine.scheduler, "schedule", "scheduler")
    timers.wrap(engine, "_record", "timeline record")
    return timers


def fill(engine, rows: int, context: int, sampling: dict) -> None:
    for i in range(rows):
        prompt = [100 + (i * 37 + j) % 30000 for j in range(context)]
        params = SamplingParams(**sampling, seed=i, max_tokens=1000, ignore_eos=True)
        engine.add_request(f"p{i}", prompt, params)
    while (
        any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or engine.scheduler.waiting
    ):
        engine.step()


def profile(engine, steps: int) -> tuple[float, float, dict[str, float]]:
    """(median step ms, median step ms with the timeline not recording, per-part ms); on and off interleaved."""
    for _ in range(3):
        engine.step()
    record = engine._record
    times = {True: [], False: []}
    for i in range(2 * steps):
        on = i % 2 == 0
        engine._record = record if on else (lambda *a: None)
        t = time.perf_counter()
        engine.step()
        times[on].append(time.perf_counter() - t)
    engine._record = record
    timers = instrument(engine)
    for _ in range(steps):
        engine.step()
    return (
        statistics.median(times[True]) * 1e3,
        statistics.median(times[False]) * 1e3,
        {k: v / steps for k, v in timers.ms.items()},
    )


def profile_prefill(engine, tokens: int, repeats: int) -> tuple[float, dict[str, float]]:
    """(median ms of the step that prefills one `tokens`-token prompt whole, per-part ms of one more)."""

    def once(i: int) -> float:
        prompt = [100 + (i * 7919 + j * 37) % 30000 for j in range(tokens)]
        engine.add_request(f"pp{i}", prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        t = time.perf_counter()
        engine.step()
        ms = (time.perf_counter() - t) * 1e3
        while engine.has_work():
            engine.step()
        return ms

    once(0)  # warm-up
    median = statistics.median(once(1 + i) for i in range(repeats))
    timers = instrument(engine)
    once(repeats + 1)
    return median, dict(timers.ms)


def print_parts(parts: dict[str, float], total_ms: float) -> None:
    outside = ("runner (all of the above)", "scheduler", "timeline record")
    inside = sum(v for k, v in parts.items() if k not in outside and not k.startswith(BY_KIND))
    for group, ms in sorted(parts.items(), key=lambda kv: -kv[1]):
        if not group.startswith(BY_KIND):
            print(f"  {group:<28} {ms:7.2f} ms")
        if group == "matmul":  # its parts by kind and type, right below it
            for kind, kms in sorted(((k, v) for k, v in parts.items() if k.startswith(BY_KIND)), key=lambda kv: -kv[1]):
                print(f"    {kind[len(BY_KIND) :]:<26} {kms:7.2f} ms")
    print(f"  {'rest of the runner':<28} {parts['runner (all of the above)'] - inside:7.2f} ms  (inputs, glue ops)")
    rest = total_ms - parts["runner (all of the above)"] - parts["scheduler"] - parts["timeline record"]
    print(f"  {'rest of the step':<28} {rest:7.2f} ms  (update, detokenize, stats; timed without the wrappers)")


def write_json(path: Path | None, engine, rows: list[dict]) -> int:
    """The measured steps with the weights they ran on, for scripts/record.py."""
    if path is not None:
        path.write_text(json.dumps({"weights": engine.info.weights, "steps": rows}, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="alias, HF directory or .gguf file")
    ap.add_argument("--weights", default="native")
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument(
        "--prefill", type=int, default=0, help="instead: one prompt of this many tokens prefilled in one step"
    )
    ap.add_argument(
        "--speculative",
        default="off",
        help="the engine's speculative decoding (default off: every step decodes one token per row)",
    )
    ap.add_argument(
        "--sampling",
        choices=sorted(sampling_presets()),
        default="greedy",
        help="what the decode rows sample with: greedy, the chat's defaults, Ollama's (scripts/benchlib.py)",
    )
    ap.add_argument("--json", type=Path, default=None, help="write the measured steps here")
    args = ap.parse_args()
    measured: list[dict] = []
    if args.prefill:
        engine = build_engine(
            EngineConfig(
                model=args.model,
                weights=args.weights,
                speculative=args.speculative,
                max_num_seqs=1,
                enable_prefix_caching=False,
                max_num_batched_tokens=args.prefill,
                kv_cache_gb=1.0,
            )
        )
        step_ms, parts = profile_prefill(engine, args.prefill, max(args.steps, 1))
        print(
            f"\n{engine.info.weights}, a {args.prefill}-token prompt prefilled in one step: {step_ms:.1f} ms "
            f"({args.prefill / step_ms * 1e3:.1f} tok/s, median of {max(args.steps, 1)}); instrumented:"
        )
        print_parts(parts, step_ms)
        measured.append({"kind": "prefill", "tokens": args.prefill, "step_ms": step_ms, "parts_ms": parts})
        return write_json(args.json, engine, measured)
    for n_rows in (int(r) for r in args.rows.split(",")):
        engine = build_engine(
            EngineConfig(
                model=args.model,
                weights=args.weights,
                speculative=args.speculative,
                max_num_seqs=max(n_rows, 1),
                enable_prefix_caching=False,
                max_num_batched_tokens=max(512, n_rows),
                kv_cache_gb=1.0,
            )
        )
        fill(engine, n_rows, args.context, sampling_presets()[args.sampling])
        step_ms, unrecorded_ms, parts = profile(engine, args.steps)
        print(
            f"\n{engine.info.weights}, {n_rows} running ({args.sampling}), context ~{args.context}: "
            f"step {step_ms:.1f} ms "
            f"({n_rows / step_ms * 1e3:.1f} tok/s; {unrecorded_ms:.1f} ms without the timeline, interleaved); "
            "per step, instrumented:"
        )
        print_parts(parts, step_ms)
        streamed = engine.info.memory.matmul_bytes_per_step
        print(
            f"  the matmuls read {streamed / 1e6:.0f} MB of weights per step: "
            f"{streamed / parts.get('matmul', float('nan')) / 1e6:.1f} GB/s"
        )
        measured.append(
            {
                "kind": "decode",
                "rows": n_rows,
                "context": args.context,
                "sampling": args.sampling,
                "step_ms": step_ms,
                "parts_ms": parts,
            }
        )
    return write_json(args.json, engine, measured)


if __name__ == "__main__":
    sys.exit(main())

"""What grammar-constrained decoding costs per token with the built-in vocabulary: llguidance against xgrammar.

  .venv/bin/python scripts/kernels/bench_grammar.py [--json results/grammar.json]

For each JSON schema both libraries compile it, then walk one valid instance token by token (the
built-in tokenizer's ids of `json.dumps(instance)`; where a library refuses the next id, the lowest id it
allows is taken instead), computing the next-token mask before every token. It reports the compile time
and the median and p95 mask time for one sequence, and for --batch (32) sequences at once (each library's batched
call). Then the engine's own cost: the median decode step of the built-in model at batch 1 and --batch with
every row under a JSON-schema grammar against the same rows unconstrained. xgrammar is optional
(`pip install --no-deps xgrammar apache-tvm-ffi`); without it only
llguidance is measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

SCHEMAS = {
    "object with required fields": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"}},
            "required": ["name", "age", "email"],
        },
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"},
    ),
    "enum": (
        {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
        {"color": "green"},
    ),
    "array of numbers": (
        {"type": "array", "items": {"type": "number"}, "minItems": 3},
        [1.5, -2, 3.25, 4e3],
    ),
    "nested": (
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
                    "required": ["id", "tags"],
                },
                "ok": {"type": "boolean"},
            },
            "required": ["user", "ok"],
        },
        {"user": {"id": 7, "tags": ["a", "bc"]}, "ok": True},
    ),
    "any JSON object": ({"type": "object"}, {"k": [1, {"x": None}], "s": "text"}),
}


def _walk(ids: list[int], allowed, consume) -> tuple[list[float], int]:
    """Mask, then consume, along ids; returns the mask times and how many tokens were taken."""
    times = []
    for tid in ids:
        started = time.perf_counter()
        mask = allowed()
        times.append(time.perf_counter() - started)
        if not mask[tid]:
            hits = np.flatnonzero(mask)
            if not len(hits):
                break
            tid = int(hits[0])
        consume(tid)
    return times, len(times)


def _bits(words: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab].astype(bool)


def bench_llguidance(tok_json: str, vocab: int, eos: int, schema: dict, ids: list[int], batch: int) -> dict:
    import llguidance
    import llguidance.numpy as lln

    tokenizer = llguidance.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos)
    started = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    compile_s = time.perf_counter() - started
    assert not matcher.is_error(), matcher.get_error()
    bitmask = lln.allocate_token_bitmask(1, vocab)

    def allowed():
        lln.fill_next_token_bitmask(matcher, bitmask, 0)
        return _bits(bitmask[0], vocab)

    times, n = _walk(ids, allowed, matcher.consume_token)
    executor = llguidance.LLExecutor()
    matchers = [llguidance.LLMatcher(tokenizer, grammar) for _ in range(batch)]
    masks = lln.allocate_token_bitmask(batch, vocab)
    batch_times = []
    for tid in ids[:n]:
        started = time.perf_counter()
        lln.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], masks)
        batch_times.append(time.perf_counter() - started)
        if not all(m.consume_token(tid) for m in matchers):
            break
    return {
        "compile_ms": compile_s * 1e3,
        "tokens": n,
        **_stats(times, "mask"),
        **_stats(batch_times, f"mask_x{batch}"),
    }


def bench_xgrammar(tok_dir: Path, vocab: int, schema: dict, ids: list[int], batch: int) -> dict:
    import torch
    import transformers
    import xgrammar as xgr

    hf = transformers.PreTrainedTokenizerFast.from_pretrained(tok_dir)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema))
    compile_s = time.perf_counter() - started
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)

    def allowed():
        matcher.fill_next_token_bitmask(bitmask, 0)
        return _bits(bitmask[0].numpy(), vocab)

    times, n = _walk(ids, allowed, matcher.accept_token)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    batched = xgr.BatchGrammarMatcher(max_threads=2)
    masks = xgr.allocate_token_bitmask(batch, vocab)
    batch_times = []
    for tid in ids[:n]:
        started = time.perf_counter()
        batched.batch_fill_next_token_bitmask(matchers, masks)
        batch_times.append(time.perf_counter() - started)
        if not all(m.accept_token(tid) for m in matchers):
            break
    del torch
    return {
        "compile_ms": compile_s * 1e3,
        "tokens": n,
        **_stats(times, "mask"),
        **_stats(batch_times, f"mask_x{batch}"),
    }


def bench_engine_step(batches: list[int], steps: int = 24) -> list[dict]:
    """Median decode-step time of the built-in model in-process, every row under a grammar or none."""
    from minibatch.engine.core.sampling_params import SamplingParams
    from minibatch.engine.factory import EngineConfig, build_engine
    from minibatch.engine.text.structured import GrammarCompiler

    engine = build_engine(EngineConfig(max_num_seqs=max(batches), num_kv_blocks=64 * max(batches), max_wait_ms=0))
    tok = engine.tokenizer
    compiler = GrammarCompiler(tok.tokenizer_json(), engine.info.vocab_size, list(engine.eos_token_ids))
    compiler.tokenizer()  # read the vocabulary before timing
    # an array of strings: long enough for every row to stay in decode for the timed steps
    schema = {"type": "array", "items": {"type": "string", "maxLength": 200}, "minItems": 64}
    prompt = tok.chat([{"role": "user", "content": "Write a long list of words as a JSON array."}])
    rows = []
    for batch in batches:
        result = {"batch": batch}
        for label, guided in (("free", False), ("grammar", True)):
            for i in range(batch):
                grammar = compiler.json_schema(schema) if guided else None
                engine.add_request(
                    f"{label}{batch}-{i}",
                    prompt,
                    SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True, grammar=grammar),
                )
            times = []
            while engine.has_work():
                started = time.perf_counter()
                engine.step()
                took = time.perf_counter() - started
                if len(engine.scheduler.running) == batch and all(
                    r.num_computed_tokens >= len(prompt) for r in engine.scheduler.running
                ):
                    times.append(took)
            result[f"{label}_step_ms"] = statistics.median(times) * 1e3 if times else float("nan")
        result["added_ms"] = result["grammar_step_ms"] - result["free_step_ms"]
        rows.append(result)
    return rows


def _stats(times: list[float], name: str) -> dict:
    ms = sorted(t * 1e3 for t in times) or [float("nan")]
    return {f"{name}_p50_ms": statistics.median(ms), f"{name}_p95_ms": ms[min(len(ms) - 1, int(0.95 * len(ms)))]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    from minibatch.engine.store.cache import resolve_model
    from minibatch.engine.text.tokenizer import TextTokenizer

    model_dir = resolve_model("smollm2-135m-instruct")
    tok = TextTokenizer(model_dir)
    vocab = 49152
    tok_json = (model_dir / "tokenizer.json").read_text()
    try:
        import xgrammar  # noqa: F401

        have_xgr = True
    except ImportError:
        have_xgr = False
        print("xgrammar not installed: measuring llguidance only", file=sys.stderr)
    rows = []
    for name, (schema, instance) in SCHEMAS.items():
        ids = tok.encode(json.dumps(instance))
        row = {
            "schema": name,
            "llguidance": bench_llguidance(tok_json, vocab, tok.eos_token_id, schema, ids, args.batch),
        }
        if have_xgr:
            row["xgrammar"] = bench_xgrammar(model_dir, vocab, schema, ids, args.batch)
        rows.append(row)
    libs = ["llguidance"] + (["xgrammar"] if have_xgr else [])
    b = args.batch
    print(
        f"{'schema':30s} {'library':11s} {'compile ms':>10s} {'tokens':>6s} "
        f"{'mask p50/p95 ms':>16s} {f'x{b} p50/p95 ms':>16s}"
    )
    for row in rows:
        for lib in libs:
            r = row[lib]
            print(
                f"{row['schema']:30s} {lib:11s} {r['compile_ms']:10.1f} {r['tokens']:6d} "
                f"{r['mask_p50_ms']:7.3f}/{r['mask_p95_ms']:<8.3f} "
                f"{r[f'mask_x{b}_p50_ms']:7.3f}/{r[f'mask_x{b}_p95_ms']:.3f}"
            )
    steps = bench_engine_step(sorted({1, args.batch}))
    print(f"\n{'decode step, built-in model':30s} {'free ms':>8s} {'grammar ms':>10s} {'added ms':>9s}")
    for r in steps:
        print(
            f"{'batch ' + str(r['batch']):30s} {r['free_step_ms']:8.2f} "
            f"{r['grammar_step_ms']:10.2f} {r['added_ms']:9.2f}"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"masks": rows, "engine_steps": steps}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Speculative decoding on real forwards: the same greedy tokens with it on as off, for every family's tiny
model and the built-in model, in a mixed batch with chunked prefill, preemption, prefix hits, n = 2, stop
strings, logprobs and a JSON schema; seeded sampling unchanged; unseeded sampling's distribution unchanged.

A verify position attends as a decode does (the same kernel over the same context), but the matmuls see
more rows, which may sum in another order: a differing token is accepted only at a near-tie the reference
proves (its top two log-probabilities closer than NEAR_TIE), and the tests count and report those.
"""

from __future__ import annotations

import math
import random

import pytest

from minibatch.engine.core.sampling_params import SamplingParams
from minibatch.engine.factory import EngineConfig, build_engine
from minibatch.engine.store.cache import DEFAULT_MODEL

NEAR_TIE = 1e-3


def run(engine, requests, check=True) -> dict:
    """requests: (id, prompt, params, share_prompt_with); every step checks the KV books."""
    reqs = {rid: engine.add_request(rid, prompt, params, share) for rid, prompt, params, share in requests}
    while engine.has_work():
        engine.step()
        if check:
            engine.scheduler.blocks.check_integrity()
    assert engine.scheduler.blocks.num_used_blocks == 0
    return reqs


def compare(ref: dict, got: dict) -> int:
    """Token-for-token equality, or a near-tie of the reference where they first differ: returns how many."""
    ties = 0
    for rid, r in ref.items():
        a, b = r.output_token_ids, got[rid].output_token_ids
        if a == b:
            continue
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert i < min(len(a), len(b)), f"{rid}: one stops early at {i} ({len(a)} vs {len(b)} tokens)"
        chosen, top = r.output_logprobs[i]
        other = dict(top).get(b[i])
        assert other is not None and chosen - other < NEAR_TIE, (
            f"{rid}: token {i} is {b[i]} with speculation, {a[i]} without, and the reference's gap "
            f"{chosen - (other if other is not None else float('-inf')):.3g} is no near-tie"
        )
        ties += 1
    return ties


def mixed_requests(vocab: int, seed: int = 0, stop: list[str] | None = None) -> list:
    """16 requests: repeating prompts (drafts to accept), random ones, two sharing a long prefix, an n = 2 pair."""
    rng = random.Random(seed)
    base = [rng.randrange(3, vocab) for _ in range(40)]
    out = []
    for i in range(16):
        if i % 4 == 0:
            motif = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 7))]
            prompt = (motif * 12)[: rng.randrange(20, 60)]
        elif i % 4 == 1:
            prompt = base + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 12))]  # prefix-cache hits
        else:
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 70))]
        params = SamplingParams(temperature=0, max_tokens=rng.randrange(8, 48), ignore_eos=True, logprobs=2)
        if stop and i % 5 == 2:
            params = SamplingParams(temperature=0, max_tokens=48, logprobs=2, stop=stop)
        out.append((f"r{i}", prompt, params, None))
    pair = [rng.randrange(3, vocab) for _ in range(30)]
    out.append(("n0", pair, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2), None))
    out.append(("n1", pair, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2), "n0"))
    return out


def engine_of(model, spec: str, **kw):
    cfg = dict(model=str(model), max_num_seqs=16, max_num_batched_tokens=64, max_wait_ms=0, dtype="float32")
    return build_engine(EngineConfig(**{**cfg, **kw}, speculative=spec))


def spec_counts(engine) -> tuple[int, int]:
    return engine.spec.drafted, engine.spec.accepted


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral", "qwen3", "phi3", "gemma2", "gemma3"])
def tiny_model(request, tmp_path_factory):
    from ..conftest import _save_tiny
    from .test_families import _save

    path = tmp_path_factory.mktemp(f"spec-{request.param}")
    return request.param, (_save_tiny if request.param in ("llama", "qwen2") else _save)(request.param, path)


def tiny_engine(path, spec: str, mode: str, blocks: int):
    """A tiny model (no tokenizer of its own: letters stand for tokens) on the C++ decode kernel, fp32."""
    from minibatch.engine.core.block_manager import BlockManager
    from minibatch.engine.core.config import SchedulerConfig
    from minibatch.engine.core.engine import LLMEngine
    from minibatch.engine.runner.kv_cache import allocate_kv_cache
    from minibatch.engine.runner.model_runner import ModelRunner
    from minibatch.engine.spec_decode.config import SpecConfig
    from minibatch.engine.weights.loader import load_model

    from .fakes import CharTokenizer
    from .test_families import backends

    model = load_model(path, backends()[-1][1], weights="float32")
    model.use_context(128)
    runner = ModelRunner(model, allocate_kv_cache(model.config, blocks, 4), 4)
    return LLMEngine(
        runner,
        CharTokenizer(),
        BlockManager(blocks, 4, window=model.config.release_window),
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=128, max_wait_ms=0),
        mode=mode,
        speculative=SpecConfig(spec) if spec != "off" else None,
    )


@pytest.mark.parametrize("mode,blocks", [("continuous", 600), ("continuous", 32), ("static", 600)])
def test_greedy_tokens_equal_with_speculation_for_every_family(tiny_model, mode, blocks, capsys):
    kind, path = tiny_model
    vocab = 250
    ref = run(tiny_engine(path, "off", mode, blocks), mixed_requests(vocab, stop=["ab", "zz"]))
    spec_engine = tiny_engine(path, "ngram", mode, blocks)
    got = run(spec_engine, mixed_requests(vocab, stop=["ab", "zz"]))
    ties = compare(ref, got)
    drafted, accepted = spec_counts(spec_engine)
    assert accepted > 0, (drafted, accepted)  # it verified drafts (random tiny models loop: most are right)
    if blocks == 32 and not spec_engine.scheduler.blocks.window:  # a window on every layer needs few blocks
        assert spec_engine.scheduler.num_preemptions > 0
    with capsys.disabled():
        print(f"\n  {kind} {mode}/{blocks}: {accepted}/{drafted} draft tokens accepted, {ties} near-ties")


def test_built_in_model_on_the_exact_weights_with_stops_logprobs_and_a_schema(builtin_model_dir):
    import json

    from minibatch.engine.text.structured import GrammarCompiler
    from minibatch.engine.text.tokenizer import TextTokenizer

    tok = TextTokenizer(builtin_model_dir)
    compiler = GrammarCompiler(tok.tokenizer_json, 49152, [2])
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    texts = [
        "Repeat this list exactly: apples, pears, plums, apples, pears, plums, apples, pears, plums.",
        "Fix the spelling and repeat the sentence: The quik brown fox jumpd over the lazy dog near the rivr.",
        "What is the capital of France?",
        "Write three short lines about the sea.",
    ]

    def requests():
        out = []
        for i, t in enumerate(texts):
            ids = tok.chat([{"role": "user", "content": t}])
            out.append((f"t{i}", ids, SamplingParams(temperature=0, max_tokens=48, logprobs=2), None))
        ids = tok.chat([{"role": "user", "content": texts[0]}])
        out.append(("stop", ids, SamplingParams(temperature=0, max_tokens=48, logprobs=2, stop=["plums"]), None))
        out.append(("n1", ids, SamplingParams(temperature=0, max_tokens=32, logprobs=2), "t0"))
        js = tok.chat([{"role": "user", "content": "Give a JSON object for Ann, aged 31, with name and age."}])
        grammar = compiler.json_schema(schema)
        out.append(("json", js, SamplingParams(temperature=0, max_tokens=40, logprobs=2, grammar=grammar), None))
        return out

    cfg = dict(weights="native-exact", num_kv_blocks=200)
    ref = run(engine_of(DEFAULT_MODEL, "off", **cfg), requests())
    spec_engine = engine_of(DEFAULT_MODEL, "ngram", **cfg)
    got = run(spec_engine, requests())
    compare(ref, got)
    drafted, accepted = spec_counts(spec_engine)
    assert accepted > 10 and drafted > accepted, (drafted, accepted)  # drafts kept and drafts rolled back
    assert "plums" not in tok.decode(got["stop"].output_token_ids)
    json.loads(tok.decode(got["json"].output_token_ids))
    assert got["t1"].num_accepted_tokens > 0  # the copy prompt is where drafts pay


@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=0.8, top_k=40, top_p=0.9),
        dict(temperature=0.7, top_p=0.95),
        dict(temperature=1.0, min_p=0.05),
        dict(temperature=1.0, typical_p=0.7, top_n_sigma=2.0, xtc_probability=0.5),
        dict(temperature=1.0, mirostat=2, mirostat_tau=3.0),
        dict(temperature=0.8, dry_multiplier=0.8, dry_allowed_length=1),
    ],
    ids=["ollama", "chat", "min-p", "typical-sigma-xtc", "mirostat", "dry"],
)
def test_seeded_sampling_is_the_same_with_speculation_alone_or_beside_others(tiny_chat_model_dir, sampling):
    """Each engine is new (as after a restart): the seed and the token's position decide the draw."""
    prompt = [100, 101, 102, 103, 104] * 6
    params = dict(**sampling, max_tokens=40, ignore_eos=True, seed=77)

    def alone(spec):
        e = engine_of(tiny_chat_model_dir, spec, num_kv_blocks=200)
        return run(e, [("s", prompt, SamplingParams(**params), None)])["s"].output_token_ids, e

    off, _ = alone("off")
    on, e = alone("ngram")
    assert on == off
    others = [  # 15 more: greedy, seeded and unseeded sampled rows
        (f"o{i}", [200 + i] * 20, SamplingParams(temperature=[0, 1.0, 0.7][i % 3], max_tokens=30, seed=i), None)
        for i in range(15)
    ]
    busy = run(e, [*others, ("s", prompt, SamplingParams(**params), None)])
    assert busy["s"].output_token_ids == off


def chi2_critical(df: int, z: float) -> float:
    """The chi-square quantile at standard-normal quantile z (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_unseeded_sampling_keeps_the_distribution(tiny_llama_dir):
    """Two-sample chi-square on the token at position 3 (after drafts could have been taken) over 400
    unseeded draws each way; z = 3.72 makes the false-failure rate 1e-4. A logit bias gathers most of the
    mass on the prompt's four tokens, so the n-gram drafts are sometimes right and sometimes wrong."""
    prompt = [10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13, 10, 11]
    counts = {}
    accepted = drafted = 0
    bias = {10: 4.0, 11: 4.0, 12: 4.0, 13: 4.0}
    for spec in ("off", "ngram"):
        e = tiny_engine(tiny_llama_dir, spec, "continuous", 600)
        reqs = [
            (f"{spec}{i}", prompt, SamplingParams(temperature=1.0, max_tokens=4, logit_bias=bias), None)
            for i in range(400)
        ]
        done = run(e, reqs, check=False)
        counts[spec] = [r.output_token_ids[3] for r in done.values()]
        if e.spec is not None:
            accepted, drafted = e.spec.accepted, e.spec.drafted
    assert 0 < accepted < drafted, (accepted, drafted)  # the draws went through verify rows, both ways
    a, b = counts["off"], counts["ngram"]
    cats = sorted(set(a) | set(b))
    # rare tokens pooled so every cell expects at least 5
    rare = {t for t in cats if a.count(t) + b.count(t) < 10}
    table = [(a.count(t), b.count(t)) for t in cats if t not in rare]
    table.append((sum(a.count(t) for t in rare), sum(b.count(t) for t in rare)))
    table = [row for row in table if sum(row)]
    na, nb = len(a), len(b)
    stat = 0.0
    for x, y in table:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    df = len(table) - 1
    assert df >= 3, table  # a distribution worth comparing
    assert stat < chi2_critical(df, 3.72), (stat, df, table)


@pytest.fixture(scope="module")
def tiny_draft_dir(tiny_chat_model_dir, tmp_path_factory):
    """A one-layer random Llama with the tiny chat model's tokenizer: a draft that is right only sometimes."""
    import shutil

    from ..conftest import save_tiny_chat

    path = save_tiny_chat(tmp_path_factory.mktemp("tiny-draft"), seed=5, layers=1)
    for f in tiny_chat_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation")) or f.suffix == ".jinja":
            shutil.copy(f, path / f.name)
    return path


@pytest.mark.parametrize("mode", ["continuous", "static"])
def test_a_draft_model_gives_the_same_tokens(tiny_chat_model_dir, tiny_draft_dir, mode):
    def requests():
        rng = random.Random(3)
        out = []
        for i in range(12):
            motif = [rng.randrange(100, 4000) for _ in range(rng.randrange(2, 6))]
            prompt = (motif * 10)[: rng.randrange(8, 50)] if i % 2 else [rng.randrange(100, 4000) for _ in range(20)]
            params = SamplingParams(temperature=0, max_tokens=rng.randrange(8, 40), ignore_eos=True, logprobs=2)
            out.append((f"r{i}", prompt, params, None))
        return out

    cfg = dict(mode=mode, num_kv_blocks=300, weights="float32")
    ref = run(engine_of(tiny_chat_model_dir, "off", **cfg), requests())
    for draft, exact in ((tiny_chat_model_dir, True), (tiny_draft_dir, False)):
        e = build_engine(
            EngineConfig(
                model=str(tiny_chat_model_dir),
                speculative="draft",
                draft_model=str(draft),
                max_num_seqs=16,
                max_wait_ms=0,
                dtype="float32",
                **cfg,
            )
        )
        got = run(e, requests())
        compare(ref, got)
        drafted, accepted = spec_counts(e)
        assert e.spec.proposer.blocks.num_used_blocks == 0  # every draft block back with its request
        if exact:  # the target drafting for itself: every guess is right
            assert drafted > 50 and accepted == drafted, (drafted, accepted)
        else:
            assert 0 < accepted < drafted, (drafted, accepted)
        assert e.info.speculative.startswith(f"draft {draft}")


def test_a_draft_with_another_vocabulary_is_refused_naming_both(tiny_chat_model_dir, tiny_draft_dir, tmp_path):
    import json
    import shutil

    other = tmp_path / "other-vocab"
    shutil.copytree(tiny_draft_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first = next(iter(vocab))
    vocab["renamed-token"] = vocab.pop(first)
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match=r"draft_model '.*other-vocab' has another vocabulary than model '.*tiny-chat"):
        build_engine(
            EngineConfig(model=str(tiny_chat_model_dir), speculative="draft", draft_model=str(other), dtype="float32")
        )
    with pytest.raises(ValueError, match="speculative draft needs a draft model"):
        EngineConfig(speculative="draft")


def test_exact_weights_answer_the_same_whatever_the_prefill_chunks():
    """Why a verify row's budget cannot change an answer on the exact path: prefill chunk boundaries (which
    the draft tokens' share of the step budget moves) leave fp32 activations' greedy answers alone. (The
    default native weights quantize activations to 8 bits per block, which turns the last-bit differences
    of another chunking into different roundings; their answers may then part at close calls, with or
    without speculation; BENCHMARKS.md, "Speculative decoding".)"""
    import json
    from pathlib import Path

    rows = [json.loads(line) for line in (Path(__file__).parents[2] / "scripts/data/chat_prompts.jsonl").open()]
    outs = []
    for budget in (512, 7):
        e = engine_of(DEFAULT_MODEL, "off", weights="native-exact", max_num_batched_tokens=budget, max_num_seqs=4)
        reqs = [
            (
                f"c{i}",
                e.tokenizer.chat([{"role": "user", "content": r["prompt"]}]),
                SamplingParams(temperature=0, max_tokens=16),
                None,
            )
            for i, r in enumerate(rows[:10])
        ]
        outs.append([r.output_token_ids for r in run(e, reqs).values()])
    assert outs[0] == outs[1]

"""The same answer whatever the batch: the built-in model on its default weights, on every CPU build.

A few requests (greedy and seeded sampled, behind a shared system prompt) are answered alone first, with no
chunking, no prefix cache and no speculation. Then the same requests run among other requests in batches of 2
to 64, with chunked prefill at several chunk sizes, hitting the prefix cache, preempted for want of KV blocks,
in static mode, with speculation on: every token must be the one they got alone. The matrix runs on the
kernels built for this CPU and for AVX2 without VNNI (MINIBATCH_CPU_BUILD), so a machine with AVX-512 tests
what an AVX2-only one runs; test_batch_invariance_portable.py runs it on x86-64's baseline build. The KV cache
is the default's (q8_0) on each build, and f16 on this CPU's: the cache type must not make answers depend on
the batch either.
"""

from __future__ import annotations

import pytest
import transformers

from minibatch.engine.core.sampling_params import SamplingParams
from minibatch.engine.factory import EngineConfig, build_engine
from minibatch.kernels.cpu import extension as cpu_ext

pytestmark = pytest.mark.model

SYSTEM = (
    "You are a patient assistant for a public library. Answer in plain words, keep to the question, and when "
    "you are not sure of a fact, say so instead of guessing. Prefer short lists over long paragraphs."
)
QUESTIONS = [
    "What is 7 times 8?",
    "Explain what a hash table is to a ten year old.",
    "Name three primary colors.",
    "Write a haiku about autumn leaves.",
]
OTHERS = [
    "Hi!",
    "Why is the sky blue? Keep it short.",
    "Give me a recipe for pancakes with the amounts for four people and the steps in order.",
    "What is the capital of Japan?",
    "How do I reverse a list in Python?",
    "Tell me a fun fact about octopuses.",
    "List the planets of the solar system in order from the sun.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
]
TOKENS = 16


def params_of(i: int) -> SamplingParams:
    """Greedy for the even requests; the chat's sampling defaults with a seed for the odd ones."""
    if i % 2 == 0:
        return SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    return SamplingParams(temperature=0.8, top_p=0.95, top_k=40, seed=100 + i, max_tokens=TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=["this-cpu", "avx2", "this-cpu:f16", "avx2:q4_0"])
def cpu_build(request):
    """The engine's kernels as built for this CPU, or for AVX2 without VNNI; and the KV cache type after a colon
    (the default's without one)."""
    if request.param == "avx2" and cpu_ext.native_is("avx2"):
        pytest.skip("this CPU's own build is the AVX2 one: the this-cpu runs are these")
    yield from use_build(request.param)


def use_build(spec: str):
    """Run the engine on the kernels of `spec`'s build (this-cpu, avx2, portable) until the fixture ends; yields
    the spec, whose KV cache type (after a colon, else auto) engine() takes."""
    build = spec.partition(":")[0]
    if cpu_ext.load_cpu_extension() is None:
        pytest.skip("the C++ extension cannot be built here")
    mp = pytest.MonkeyPatch()
    if build != "this-cpu":
        mp.setenv(cpu_ext.BUILD_VARIABLE, build)
    mp.setattr(cpu_ext, "_ext", None)
    mp.setattr(cpu_ext, "_tried", False)
    ext = cpu_ext.load_cpu_extension()
    if build != "this-cpu":  # this CPU's build is whatever MINIBATCH_CPU_BUILD or the machine makes it
        assert ext.int_path_has_avx2() == (build == "avx2") and not ext.int_path_has_vnni()
    yield spec
    mp.undo()


@pytest.fixture(scope="module")
def chats(builtin_model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(builtin_model_dir)

    def ids(text: str, system: bool = True) -> list[int]:
        messages = [{"role": "system", "content": SYSTEM}] if system else []
        out = tok.apply_chat_template(messages + [{"role": "user", "content": text}], add_generation_prompt=True)
        return list(out["input_ids"]) if hasattr(out, "keys") else list(out)

    # the test requests behind the system prompt; the others mostly without (short prompts, a quick suite)
    return [ids(q) for q in QUESTIONS], [ids(q, system=i % 4 == 0) for i, q in enumerate(OTHERS)]


def engine(spec: str, **kw):
    kv_type = spec.partition(":")[2] or "auto"
    cfg = dict(dtype="float32", weights="native", max_num_seqs=64, num_kv_blocks=800, max_wait_ms=0)
    eng = build_engine(EngineConfig(**{**cfg, "kv_cache_type": kv_type, **kw}))
    assert eng.info.kv_cache_type == (kv_type if kv_type != "auto" else "q8_0")
    return eng


def run(eng, tests, others, n_others: int, waves: int = 1, batch: int = 0):
    """The test requests among `n_others` other requests (greedy and sampled, unseeded too), submitted in
    `waves` groups a few steps apart; returns the test requests' tokens. `batch`: the size the running batch
    must reach at some step."""
    mine, reqs, peak = [], [], 0
    for i, p in enumerate(tests):
        reqs.append((f"t{i}", p, params_of(i), True))
    for j in range(n_others):
        params = SamplingParams(temperature=[0, 1.0, 0.7][j % 3], max_tokens=8 + j % 13, ignore_eos=True)
        reqs.insert(
            (j * 7) % (len(reqs) + 1), (f"o{j}", others[j % len(others)] + [j % 50 + 10] * (j % 5), params, False)
        )
    per_wave = -(-len(reqs) // waves)
    step = 0
    while reqs or eng.has_work():
        if reqs and step % 3 == 0:
            for rid, p, params, is_test in reqs[:per_wave]:
                r = eng.add_request(rid, p, params)
                if is_test:
                    mine.append(r)
            reqs = reqs[per_wave:]
        eng.step()
        peak = max(peak, len(eng.scheduler.running))
        step += 1
    assert eng.scheduler.blocks.num_used_blocks == 0
    assert peak >= batch, f"the batch reached {peak} rows, not {batch}"
    return {r.request_id: list(r.output_token_ids) for r in mine}


@pytest.fixture(scope="module")
def alone(cpu_build, chats):
    tests, _ = chats
    eng = engine(cpu_build, enable_prefix_caching=False, speculative="off", max_num_batched_tokens=4096)
    out = {}
    for i, p in enumerate(tests):
        r = eng.add_request(f"t{i}", p, params_of(i))
        while eng.has_work():
            eng.step()
        out[r.request_id] = list(r.output_token_ids)
    assert all(len(t) == TOKENS for t in out.values())
    return out


# other requests, tokens per forward (the chunk), waves of arrivals, speculation, rows the batch must reach
BATCHES = {
    "batch-2": (1, 512, 1, "ngram", 2),
    "batch-8-chunk-64": (7, 64, 1, "off", 8),
    "16-requests-chunk-17": (15, 17, 3, "ngram", 4),  # 17 tokens a step: prompts cross several steps
    "batch-64": (60, 2048, 1, "ngram", 64),
}


# a cache type other than the default's runs these of the batches (prefill chunks crossing steps and blocks, the
# widest batch), beside the prefix cache, static mode and preemption; the default's runs every one
CACHE_TYPE_BATCHES = ((15, 17), (60, 2048))


@pytest.mark.parametrize("others,chunk,waves,speculative,rows", BATCHES.values(), ids=BATCHES.keys())
def test_continuous_batches_and_chunks(cpu_build, chats, alone, others, chunk, waves, speculative, rows):
    if ":" in cpu_build and (others, chunk) not in CACHE_TYPE_BATCHES:
        pytest.skip("a cache type of its own runs the chunked and the widest batches")
    seqs = min(64, chunk)  # every running row decodes each step
    eng = engine(
        cpu_build, enable_prefix_caching=False, speculative=speculative, max_num_batched_tokens=chunk, max_num_seqs=seqs
    )
    assert run(eng, *chats, others, waves, batch=rows) == alone


def test_prefix_hits_static_mode_and_preemption(cpu_build, chats, alone):
    tests, others = chats
    eng = engine(cpu_build, max_num_batched_tokens=128)  # the prefix cache and ngram speculation on, as by default
    run(eng, [], others, 3)  # caches the system prompt's blocks
    hits = eng.scheduler.blocks.prefix_hits
    assert run(eng, tests, others, 5, waves=2) == alone
    assert eng.scheduler.blocks.prefix_hits > hits

    eng.set_mode("static")
    assert run(eng, tests, others, 11, waves=2) == alone
    assert eng.scheduler.wasted_row_steps > 0

    small = engine(cpu_build, enable_prefix_caching=False, num_kv_blocks=20, max_num_seqs=16, max_num_batched_tokens=64)
    assert run(small, tests, others, 12, waves=2) == alone
    assert small.scheduler.num_preemptions > 0

"""n > 1: the prompt is computed once, its full blocks shared by the siblings, every completion as if alone."""

from __future__ import annotations

import pytest

from minibatch.engine.core.sampling_params import SamplingParams
from minibatch.engine.factory import EngineConfig, build_engine

PROMPT = list(range(200, 250))  # 50 tokens: 3 full blocks of 16 shared, 2 tokens each sibling computes itself
N = 4


def make(model_dir, **kw):
    config = dict(
        model=str(model_dir),
        dtype="float32",
        max_num_seqs=8,
        num_kv_blocks=200,
        max_wait_ms=0,
        enable_prefix_caching=False,
    )  # so every shared block is a sibling's, not a cache hit
    return build_engine(EngineConfig(**{**config, **kw}))


def run(engine, on_step=None):
    """Step until done, checking the blocks each step; returns how many prompt tokens the forwards computed."""
    prompt_tokens = 0
    execute = engine.runner.execute

    def counting(sched):
        nonlocal prompt_tokens
        for r, n in zip(sched.requests, sched.num_new_tokens):
            start = r.num_computed_tokens  # not yet advanced
            prompt_tokens += max(0, min(start + n, r.num_prompt_tokens) - start)
        return execute(sched)

    engine.runner.execute = counting
    while engine.has_work():
        engine.step()
        engine.scheduler.blocks.check_integrity()
        if on_step:
            on_step()
    assert engine.scheduler.blocks.num_used_blocks == 0
    return prompt_tokens


def alone(model_dir, params: SamplingParams) -> list[int]:
    e = make(model_dir)
    r = e.add_request("x", PROMPT, params)
    run(e)
    return r.output_token_ids


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_siblings_share_the_prompt_and_equal_their_runs_alone(tiny_chat_model_dir, seeded):
    def params(i):
        return SamplingParams(
            temperature=0.9 if seeded else 0, seed=100 + i if seeded else None, max_tokens=24, ignore_eos=True
        )

    e = make(tiny_chat_model_dir)
    reqs = [e.add_request(f"r{i}", PROMPT, params(i), share_prompt_with="r0" if i else None) for i in range(N)]
    shared_refs = []

    def look():
        if all(r.block_ids for r in reqs):
            shared_refs.append([e.scheduler.blocks.blocks[b].ref_count for b in reqs[0].block_ids[:3]])

    computed = run(e, look)
    assert computed == len(PROMPT) + (N - 1) * (len(PROMPT) - 48)  # 56 prompt tokens computed, not 200
    assert shared_refs and all(refs == [N] * 3 for refs in shared_refs)
    assert all(r.block_ids == [] for r in reqs)
    for i, r in enumerate(reqs):
        assert r.output_token_ids == alone(tiny_chat_model_dir, params(i)), i
        assert r.num_cached_tokens == (0 if i == 0 else 48)
    if seeded:
        assert len({tuple(r.output_token_ids) for r in reqs}) > 1


def test_preempting_or_aborting_siblings_keeps_every_block_accounted_for(tiny_chat_model_dir):
    # 9 usable blocks: the four cannot all grow to 74 tokens at once (5 blocks the first, 2 more each sibling)
    e = make(tiny_chat_model_dir, num_kv_blocks=10)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reqs = [e.add_request(f"r{i}", PROMPT, params, share_prompt_with="r0" if i else None) for i in range(N)]
    run(e)
    assert e.scheduler.num_preemptions > 0
    want = alone(tiny_chat_model_dir, params)
    assert all(r.output_token_ids == want for r in reqs)

    e = make(tiny_chat_model_dir)
    reqs = [e.add_request(f"a{i}", PROMPT, params, share_prompt_with="a0" if i else None) for i in range(N)]
    steps = 0

    def abort_some():
        nonlocal steps
        steps += 1
        if steps == 3:
            e.abort("a0")  # the leader, while its siblings hold its blocks
        if steps == 5:
            e.abort("a2")

    run(e, abort_some)
    assert [len(r.output_token_ids) for r in reqs][1::2] == [24, 24] and reqs[0].status.finish_reason == "abort"
    assert reqs[1].output_token_ids == want and reqs[3].output_token_ids == want

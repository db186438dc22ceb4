"""Shifted reuse (engine/core/kv_reuse.py, runner/kv_shift.py): which runs of a recent prompt a request takes,
that the rows it copies are the keys computed at the new positions (layer 0, where a key depends on its token
and position alone), that what is approximate never reaches an exact request or the disk tier, and that the
bookkeeping (held spans, pins, preemption, eviction) leaks nothing."""

from __future__ import annotations

import random

import pytest
import torch

from minibatch.engine.core.block_manager import BlockManager
from minibatch.engine.core.kv_reuse import ReuseSource, Run, plan_runs
from minibatch.engine.core.request import Request
from minibatch.engine.core.sampling_params import SamplingParams
from minibatch.engine.factory import EngineConfig, build_engine
from minibatch.kernels.kv_types import from_cache_ref, hadamard_ref, rotation, type_of

BS = 16


def src(tokens) -> ReuseSource:
    return ReuseSource(list(tokens), [], None)


def seq(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(100, 20000) for _ in range(n)]


# -- the plan ------------------------------------------------------------------------------------------------


def test_lines_gone_from_the_top_are_one_shifted_run_after_the_common_prefix():
    old = seq(400, 1)
    new = old[:40] + old[100:]  # 60 tokens of the window's top gone
    runs = plan_runs(src(old), len(old), new, 32, len(new) - 1, 64)
    assert runs == [Run(32, 32, 8), Run(100, 40, len(new) - 1 - 40)]
    assert runs[1].shift == -60


def test_a_run_shorter_than_the_minimum_is_computed_not_taken():
    old = seq(300, 2)
    new = old[:50] + [7] + old[60:100] + [8] + old[100:]  # 40 tokens between the insertions
    runs = plan_runs(src(old), len(old), new, 0, len(new) - 1, 64)
    assert [(r.src, r.dst) for r in runs] == [(0, 0), (100, 92)]
    assert runs[0].length == 50


def test_inserted_tokens_leave_a_gap_and_the_run_after_them_is_taken():
    old = seq(300, 3)
    new = old[:120] + [5, 6, 7] + old[120:]  # a word typed at the cursor
    runs = plan_runs(src(old), len(old), new, 0, len(new) - 1, 64)
    assert runs == [Run(0, 0, 120), Run(120, 123, len(new) - 1 - 123)]


def test_the_plan_leaves_the_last_token_and_stays_in_the_usable_blocks():
    old = seq(200, 4)
    assert plan_runs(src(old), len(old), list(old), 0, 199, 64) == [Run(0, 0, 199)]
    runs = plan_runs(src(old), 64, old[:10] + old[20:], 0, 189, 16)  # blocks past 64 evicted
    assert all(r.src + r.length <= 64 for r in runs) and runs[-1].src + runs[-1].length == 64


def test_a_run_after_a_change_settles_its_first_tokens_the_common_prefix_does_not():
    old = seq(300, 9)
    new = old[:120] + [5, 6, 7] + old[120:200] + old[210:]
    runs = plan_runs(src(old), len(old), new, 0, len(new) - 1, 32, settle=16)
    # the common prefix as it is; after the word and after the 10 deleted tokens, 16 tokens computed each time
    assert runs == [Run(0, 0, 120), Run(136, 139, 64), Run(226, 219, len(new) - 1 - 219)]
    short = old[:50] + [5] + old[50:70] + [6] + old[70:]  # a run of 20 after the first word: under 16 + 32
    assert [r.dst for r in plan_runs(src(old), len(old), short, 0, len(short) - 1, 32, settle=16)] == [0, 88]


def test_llama_servers_rule_the_first_place_far_enough():
    run = seq(80, 5)
    old = seq(30, 6) + run + seq(30, 7) + run
    new = seq(30, 8) + run
    runs = plan_runs(src(old), len(old), new + [1], 0, len(new), 64)
    assert runs == [Run(30, 30, 80)]  # (the first place the run starts at, not the later one)


# -- the engine ----------------------------------------------------------------------------------------------


def make(model_dir, **kw):
    cfg = dict(model=str(model_dir), num_kv_blocks=96, block_size=BS, max_num_seqs=4, speculative="off",
               cache_reuse=32)  # fmt: skip
    return build_engine(EngineConfig(**{**cfg, **kw}))


def run(engine, prompt, reuse=True, n=4, keep=None):
    """Greedy tokens and metrics; `keep`: a list that gets each layer's K and V rows of the prompt's positions,
    as the cache held them once the prompt was in."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    rid = f"r{random.random()}"
    req = engine.add_request(rid, prompt, params, reuse_shifted=reuse)
    tokens, final = [], None
    while engine.has_work():
        outs, _ = engine.step()
        if keep is not None and not keep and req.output_token_ids:
            keep.extend(rows(engine, req, len(prompt)))
        for o in outs:
            tokens += o.token_ids
            final = o if o.finished else final
    engine.scheduler.blocks.check_integrity()
    return tokens, final.metrics


def rows(engine, req, n):
    slots = torch.tensor([req.block_ids[p // BS] * BS + p % BS for p in range(n)])
    out, head_dim = [], engine.runner.model.config.head_dim
    for kv in engine.runner.kv_caches:  # (a type that keeps K turned: as turned back, the model's own keys)
        k = hadamard_ref(from_cache_ref(kv.k.view(-1, *kv.k.shape[2:])[slots], head_dim), rotation_of(kv.k, head_dim))
        v = kv.v.view(-1, *kv.v.shape[2:])[slots].clone()
        out.append((k, v))
    return out


def rotation_of(cache, head_dim: int) -> int:
    return rotation(type_of(cache, head_dim), head_dim, "k")


def free_blocks_settle(engine):
    bm = engine.scheduler.blocks
    assert not bm.pinned and bm.num_free_blocks == bm.num_usable_blocks
    bm.check_integrity()


@pytest.mark.parametrize("kv", ["f32", "f16", "q8_0", "q4_0"])
def test_moved_keys_are_the_keys_computed_at_the_new_positions(tiny_chat_model_dir, kv):
    old = seq(180, 10)
    new = old[:20] + old[60:]  # 40 tokens gone: the rest moved 40 places down
    quantized = kv in ("q8_0", "q4_0")  # (block types: heads of 32 values or more)
    model = "smollm2-135m-instruct" if quantized else tiny_chat_model_dir
    engine, fresh = make(model, kv_cache_type=kv), make(model, kv_cache_type=kv)
    run(engine, old)
    got, want = [], []
    _, m = run(engine, new, keep=got)
    run(fresh, new, reuse=False, keep=want)
    assert m.reused_prompt_tokens >= 100 and m.cached_prompt_tokens == 16 + m.reused_prompt_tokens
    moved = slice(24, 140)  # inside the shifted run (past the common prefix's partial block)
    (k, v), (k0, v0) = got[0], want[0]
    if kv == "f32":
        torch.testing.assert_close(k[moved], k0[moved], rtol=2e-6, atol=2e-6)
    elif kv == "f16":
        torch.testing.assert_close(k[moved], k0[moved], rtol=2e-3, atol=2e-3)  # one more rounding to f16
    elif kv == "q4_0":  # kept Hadamard-turned: turned back, rotary-turned, turned again and stored. Three roundings
        # of q4_0 (about 9% RMS of a row each, the source, the moved and the fresh one) against the model's keys;
        # a rotary turn done in the Hadamard frame would be as far off as the keys are large
        err = (k[moved] - k0[moved]).norm(dim=-1) / k0[moved].norm(dim=-1)
        assert 0 < err.mean() < 0.25, err.mean()
    else:  # the source row's rounding (half a step of each half's block, turned together), then the moved
        # row's and the fresh one's own (half a step each): within 1.5 + 0.5 * sqrt(2) of a head's largest step
        step = k0[moved].abs().reshape(*k0[moved].shape[:-1], -1, 32).amax(-1).amax(-1) / 127
        worst = ((k[moved] - k0[moved]).abs().amax(-1) / step).max().item()
        assert 0 < worst <= 1.5 + 0.5 * 2**0.5, worst
    assert torch.equal(v[moved], v0[moved])  # values move as they are
    # a deeper layer's rows followed the old context, not the new one: they differ (what reuse trades)
    assert not torch.allclose(got[-1][0][moved], want[-1][0][moved])
    free_blocks_settle(engine)


def test_an_exact_request_never_gets_shifted_blocks_nor_does_the_disk_tier(tiny_chat_model_dir):
    old = seq(180, 11)
    new = old[:20] + old[60:]
    engine = make(tiny_chat_model_dir)
    bm = engine.scheduler.blocks
    bm.registered = []
    run(engine, old)
    saved = len(bm.take_registered())
    _, m = run(engine, new)
    assert m.reused_prompt_tokens > 0
    # its second block (rows 16-19 copied unshifted, 20-31 computed: the run settles 16 tokens in) is exact and
    # offered; the shifted ones are not
    assert [key.tokens for key, _ in bm.take_registered()] == [tuple(new[16:32])]
    tokens, exact = run(engine, new, reuse=False)
    assert exact.cached_prompt_tokens == 32 and exact.reused_prompt_tokens == 0
    assert tokens == run(make(tiny_chat_model_dir), new, reuse=False)[0]
    assert saved == (len(old) - 1) // BS
    free_blocks_settle(engine)


def test_the_rest_of_a_common_prefix_copied_unshifted_is_exact(tiny_chat_model_dir):
    base = seq(100, 12)
    engine = make(tiny_chat_model_dir)
    run(engine, base + seq(30, 13))
    prompt = base + seq(30, 14)
    tokens, m = run(engine, prompt)
    assert m.reused_prompt_tokens == 100 - 96 and m.cached_prompt_tokens == 100
    assert tokens == run(make(tiny_chat_model_dir), prompt, reuse=False)[0]
    assert not engine.scheduler.blocks.req_approx
    _, again = run(engine, prompt, reuse=False)  # its blocks are exact: an exact request hits them
    assert again.cached_prompt_tokens == (len(prompt) - 1) // BS * BS
    free_blocks_settle(engine)


def test_a_word_typed_in_the_middle_is_computed_and_the_rest_held(tiny_chat_model_dir):
    old = seq(200, 15)
    new = old[:90] + [101, 102, 103] + old[90:]
    engine = make(tiny_chat_model_dir, max_num_batched_tokens=64)
    run(engine, old)
    tokens, m = run(engine, new)
    held = (len(old) + 4 - 1) // BS * BS  # the source: its full blocks (prompt and answer)
    # the common prefix's rest, then the run after the word, its first 16 tokens computed (settled)
    assert m.reused_prompt_tokens == 10 + held - 90 - 16
    assert m.cached_prompt_tokens == 80 + m.reused_prompt_tokens
    assert len(tokens) == 4
    free_blocks_settle(engine)


def test_without_leave_a_request_reuses_nothing_and_cache_reuse_0_turns_it_off(tiny_chat_model_dir):
    old = seq(180, 16)
    new = old[:20] + old[60:]
    for engine, reuse in ((make(tiny_chat_model_dir), False), (make(tiny_chat_model_dir, cache_reuse=0), True)):
        run(engine, old, reuse=reuse)
        _, m = run(engine, new, reuse=reuse)
        assert m.reused_prompt_tokens == 0 and m.cached_prompt_tokens == 16


def test_static_mode_reuses_too(tiny_chat_model_dir):
    old = seq(180, 17)
    new = old[:20] + old[60:] + [5, 6, 7]
    engine = make(tiny_chat_model_dir, mode="static", max_wait_ms=0)
    run(engine, old)
    tokens, m = run(engine, new)
    assert m.reused_prompt_tokens > 100 and len(tokens) == 4
    free_blocks_settle(engine)


def test_a_preempted_request_with_held_spans_finishes_and_leaks_nothing(tiny_chat_model_dir):
    old = seq(150, 18)
    engine = make(tiny_chat_model_dir, num_kv_blocks=20, max_num_batched_tokens=32)
    run(engine, old)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request("a", old[:30] + [9, 9] + old[30:], params, reuse_shifted=True)
    engine.add_request("b", seq(150, 19), params)
    done = {}
    while engine.has_work():
        outs, _ = engine.step()
        engine.scheduler.blocks.check_integrity()
        done.update({o.request_id: o for o in outs if o.finished})
    assert engine.scheduler.num_preemptions > 0
    assert all(len(o.token_ids) >= 0 and o.finish_reason == "length" for o in done.values())
    free_blocks_settle(engine)


def test_a_source_block_evicted_before_the_copy_cuts_the_plan():
    bm = BlockManager(16, 4)
    bm.registered = None
    old = Request("old", list(range(1, 34)), SamplingParams(max_tokens=1), reuse_shifted=True)
    assert bm.allocate(old, 33)
    old.num_computed_tokens = 33
    bm.cache_full_blocks(old)
    bm.free(old)  # a source of 8 blocks
    new = Request("new", list(range(1, 3)) + list(range(5, 34)), SamplingParams(max_tokens=1), reuse_shifted=True)
    plan = bm.plan_reuse(new, [], 8)
    assert plan is not None and plan.end == 30
    # the source's oldest-freed blocks (its tail) are handed out first: allocate past the free ones
    other = Request("other", [99] * 12, SamplingParams(max_tokens=1))
    assert bm.allocate(other, 12)
    assert bm.allocate(new, 31)
    moves, spans = bm.take_reuse(new, plan)
    assert all(s // 4 != d // 4 for s, d, _ in moves)
    assert spans == [(0, 14)]  # cut where the evicted blocks began: the source's first 4 blocks are left
    bm.unpin_all()
    bm.free(new), bm.free(other)
    bm.check_integrity()


def test_a_gap_is_computed_as_the_prompt_says_and_the_run_after_it_moved(tiny_chat_model_dir):
    old = seq(200, 20)
    new = old[:90] + [101, 102, 103] + old[90:]
    engine, fresh = make(tiny_chat_model_dir), make(tiny_chat_model_dir)
    run(engine, old)
    got, want = [], []
    _, m = run(engine, new, keep=got)
    run(fresh, new, reuse=False, keep=want)
    assert m.reused_prompt_tokens == 10 + 192 - 90 - 16
    # before the run (the word and the 16 tokens after it computed: settled): every layer as computed, bit for bit
    for (k, v), (k0, v0) in zip(got, want):
        assert torch.equal(k[:109], k0[:109]) and torch.equal(v[:109], v0[:109])
    (k, v), (k0, v0) = got[0], want[0]  # the run after them, three places on: layer 0 as computed there
    torch.testing.assert_close(k[109:180], k0[109:180], rtol=2e-6, atol=2e-6)
    assert torch.equal(v[109:180], v0[109:180])
    free_blocks_settle(engine)


def test_a_forward_for_requests_all_aborted_meanwhile_stops_between_layers(tiny_chat_model_dir):
    engine = make(tiny_chat_model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("gone", seq(120, 21), params, reuse_shifted=True)
    engine.abort_soon("gone")  # (the client closed its connection while its step was being planned)
    outs, stats = engine.step()
    assert stats is None and engine.abandoned_steps == 1
    assert engine.abort("gone")
    outs, _ = engine.step()
    assert not engine.has_work() and engine.scheduler.blocks.num_used_blocks == 0
    # one of two requests aborted: the forward runs to its end for the other
    engine.add_request("stays", seq(60, 22), params)
    engine.add_request("goes", seq(60, 23), params)
    engine.abort_soon("goes")
    outs, stats = engine.step()
    assert stats is not None and engine.abandoned_steps == 1
    engine.abort("goes")
    tokens = [t for o in outs if o.request_id == "stays" for t in o.token_ids]
    while engine.has_work():
        outs, _ = engine.step()
        tokens += [t for o in outs if o.request_id == "stays" for t in o.token_ids]
    assert len(tokens) == 4 and tokens == run(make(tiny_chat_model_dir), seq(60, 22), reuse=False)[0]
    free_blocks_settle(engine)

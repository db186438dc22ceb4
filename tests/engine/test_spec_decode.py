"""Speculative decoding, torch-free: the n-gram proposer, the draft-length rule, and the engine's verify,
rollback and block accounting with a fake runner that copies (so drafts are often right, sometimes not)."""

from __future__ import annotations

import pytest

from minibatch.engine.core.block_manager import BlockManager
from minibatch.engine.core.config import SchedulerConfig
from minibatch.engine.core.engine import LLMEngine
from minibatch.engine.core.sampling_params import InvalidParameterError, SamplingParams
from minibatch.engine.spec_decode.config import MAX_NUM_TOKENS, SpecConfig
from minibatch.engine.spec_decode.draft_length import StepCost, draft_depth
from minibatch.engine.spec_decode.ngram import NgramIndex

from .fakes import CharTokenizer, Clock, FakeRunner


# -- the proposer -------------------------------------------------------------
def index(tokens: list[int], n_min: int = 1, n_max: int = 4) -> NgramIndex:
    ix = NgramIndex(n_min, n_max)
    ix.extend(tokens)
    return ix


def test_ngram_proposes_what_followed_the_longest_earlier_suffix():
    # suffix [7, 8, 9] occurred at 1..3 (followed by 4, 5); [9] alone also occurred at 6 (followed by 0)
    ix = index([6, 7, 8, 9, 4, 5, 9, 0, 7, 8, 9])
    assert ix.propose(2) == [4, 5]
    assert ix.propose(5) == [4, 5, 9, 0, 7]
    ix.extend([4])  # the suffix is now [7, 8, 9, 4]: it continues where it left off
    assert ix.propose(3) == [5, 9, 0]


def test_ngram_never_matches_its_own_suffix_and_stops_at_the_end():
    assert index([1, 2, 3, 4]).propose(4) == []  # no token repeats: nothing to propose
    assert index([5, 5]).propose(3) == [5]  # the earlier 5 is followed by the last token only
    assert index([1, 2, 1, 2]).propose(4) == [1, 2]  # the continuation ends where the sequence does
    assert index([1, 2, 1, 2], n_min=3).propose(4) == []  # [2, 1, 2] never occurred before
    assert index([3, 1, 2, 3]).propose(0) == []


def test_ngram_picks_up_the_copy_past_an_edited_token():
    # the prompt's run 1 2 3 4 5 6 is being copied with its 3 replaced by 9: no suffix ending in 9 occurred,
    # but the two tokens before it did, and three tokens on from them the run goes on
    ix = index([1, 2, 3, 4, 5, 6, 0, 1, 2, 9])
    assert ix.propose(3) == [4, 5, 6]
    assert index([1, 2, 3, 4, 5, 6, 0, 1, 2, 9, 8]).propose(2) == [5, 6]  # 9 8 in place of 3 4
    assert index([7, 1, 2, 9]).propose(3) == []  # [1, 2] never occurred before its own place
    assert index([1, 2, 3, 0, 2, 9]).propose(3) == []  # one token before the edit is too weak a hint


def test_ngram_grows_incrementally_as_one_build_would():
    tokens = [4, 1, 2, 3, 1, 2, 4, 1, 2, 3, 3, 1, 2]
    grown = NgramIndex(1, 3)
    for i, t in enumerate(tokens):
        grown.extend([t])
        assert grown.propose(3) == index(tokens[: i + 1], 1, 3).propose(3)


# -- the draft-length rule -----------------------------------------------------
def test_draft_depth_shrinks_as_the_batch_grows_and_acceptance_falls():
    cost = StepCost(fixed=5e-3, per_token=3e-4)
    by_rows = [draft_depth(0.8, rows, cost, 8) for rows in (1, 4, 16, 64, 256)]
    assert by_rows == sorted(by_rows, reverse=True) and by_rows[0] == 8 and by_rows[-1] == 0, by_rows
    by_rate = [draft_depth(rate, 4, cost, 8) for rate in (0.95, 0.8, 0.5, 0.2, 0.05)]
    assert by_rate == sorted(by_rate, reverse=True) and by_rate[-1] == 0, by_rate
    assert draft_depth(1.0, 1, cost, 3) == 3 and draft_depth(0.9, 1, cost, 0) == 0
    # a step whose every token costs as much as its fixed part: a verify row never pays
    assert draft_depth(0.99, 8, StepCost(fixed=1e-3, per_token=1.0), 8) == 0


def test_step_cost_fits_the_line_of_the_steps_it_sees():
    cost = StepCost()
    for i in range(64):
        tokens = 1 + i % 12
        cost.observe(tokens, 0.004 + 0.0005 * tokens)
    assert cost.fixed == pytest.approx(0.004, rel=1e-6) and cost.per_token == pytest.approx(0.0005, rel=1e-6)
    flat = StepCost(fixed=1.0, per_token=2.0)
    for _ in range(64):
        flat.observe(3, 0.01)  # one token count only: no slope to fit, the prior stays
    assert (flat.fixed, flat.per_token) == (1.0, 2.0)


def test_step_cost_refits_every_few_steps_once_its_window_is_full(monkeypatch):
    from minibatch.engine.spec_decode import draft_length

    cost = StepCost()
    fits = []
    real = cost._fit
    monkeypatch.setattr(cost, "_fit", lambda: (fits.append(1), real()))
    n = draft_length.COST_WINDOW * 3
    for i in range(n):
        cost.observe(1 + i % 12, 0.004 + 0.0005 * (1 + i % 12))
    assert len(fits) == n // draft_length.REFIT_EVERY  # not once a step after the window filled
    assert cost.per_token == pytest.approx(0.0005, rel=1e-6)


def test_bad_options_name_the_field_and_the_limit():
    from minibatch.engine.factory import EngineConfig

    for bad in (0, MAX_NUM_TOKENS + 1, 2.5, True):
        with pytest.raises(ValueError, match=rf"num_speculative_tokens must be an integer in \[1, {MAX_NUM_TOKENS}\]"):
            EngineConfig(num_speculative_tokens=bad)
    with pytest.raises(ValueError, match="speculative must be one of off, ngram, draft, got 'eagle'"):
        EngineConfig(speculative="eagle")
    with pytest.raises(InvalidParameterError, match="speculative: must be a boolean") as info:
        SamplingParams(speculative="yes")
    assert info.value.field == "speculative"


# -- the engine with a fake runner ----------------------------------------------
class CopyRunner(FakeRunner):
    """Next token: the one `period` back, except where a hash of the history says otherwise (about one in
    five), so a sequence repeats itself with mutations: n-gram drafts are mostly right, sometimes not."""

    period = 5

    def next_token(self, tokens: list[int]) -> int:
        h = (sum(tokens) * 2654435761 + len(tokens) * 40503) % 1000
        if len(tokens) < self.period or h < 200:
            return h % self.vocab + 3
        return tokens[-self.period]


def make_engine(spec: SpecConfig | None, mode="continuous", blocks=400, block_size=4, seqs=8, budget=64):
    clock = Clock()
    runner = CopyRunner(block_size, vocab=40)
    engine = LLMEngine(
        runner,
        CharTokenizer(),
        BlockManager(blocks, block_size),
        SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=512, max_wait_ms=0),
        eos_token_ids=(),
        mode=mode,
        clock=clock,
        speculative=spec,
    )
    return engine, runner


def run_all(engine, requests, check=True):
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    done, steps = {}, 0
    while engine.has_work():
        outputs, _ = engine.step()
        steps += 1
        if check:
            bm = engine.scheduler.blocks
            bm.check_integrity()
            for req in engine.scheduler.running:  # every registered block holds verified tokens only
                for i, bid in enumerate(req.block_ids[: bm.req_num_hashed.get(req.request_id, 0)]):
                    block = bm.blocks[bid]
                    if bid and block.token_ids is not None:
                        assert block.token_ids == tuple(req.tokens(i * bm.block_size, (i + 1) * bm.block_size))
                assert req.num_computed_tokens <= req.num_tokens
        for out in outputs:
            done.setdefault(out.request_id, []).extend(out.token_ids)
    return done, steps


def workload(n=16, seed=0):
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 43) for _ in range(rng.randrange(3, 30))]
        out.append((f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=rng.randrange(1, 60))))
    return out


@pytest.mark.parametrize("mode", ["continuous", "static"])
@pytest.mark.parametrize("blocks", [400, 24], ids=["roomy", "preempting"])
def test_same_tokens_with_speculation_on_and_off_and_every_block_back(mode, blocks):
    off, _ = make_engine(None, mode, blocks=blocks if mode == "continuous" else 400)
    want, steps_off = run_all(off, workload())
    on, _ = make_engine(SpecConfig("ngram", 4), mode, blocks=blocks if mode == "continuous" else 400)
    got, steps_on = run_all(on, workload())
    assert got == want
    assert all(len(got[rid]) == p.max_tokens for rid, _, p in workload())  # max_tokens met, never passed
    spec = on.spec
    assert spec.accepted > 20 and spec.drafted > spec.accepted, (spec.drafted, spec.accepted)  # both outcomes seen
    assert steps_on < steps_off
    assert on.scheduler.blocks.num_used_blocks == 0
    if blocks == 24 and mode == "continuous":
        assert on.scheduler.num_preemptions > 0
    state = on.state()
    assert (state.speculative, state.draft_tokens, state.accepted_tokens) == ("ngram", spec.drafted, spec.accepted)


def test_a_verify_step_rolls_back_rejected_positions():
    engine, runner = make_engine(SpecConfig("ngram", 8), budget=64)
    req = engine.add_request("a", [3, 4, 5, 6, 7] * 4, SamplingParams(temperature=0, max_tokens=60))
    bm, rejections = engine.scheduler.blocks, 0
    while engine.has_work():
        before = len(req.output_token_ids)
        engine.step()
        out = runner.steps[-1]
        draft = out.drafts[0] if out.requests else []
        taken = len(req.output_token_ids) - before
        if draft and taken - 1 < len(draft) and not req.status.finished:
            rejections += 1
            # the rejected positions are not computed; the last taken token is computed next step
            assert req.num_computed_tokens == req.num_tokens - 1
            assert len(req.block_ids) == bm.blocks_needed(req.num_computed_tokens)  # their blocks went back
    assert rejections > 0 and bm.num_used_blocks == 0


def test_a_request_that_opts_out_never_verifies_and_a_failing_one_stops():
    engine, runner = make_engine(SpecConfig("ngram", 4))
    reqs = [
        ("out", [3, 4, 5, 6, 7] * 4, SamplingParams(temperature=0, max_tokens=40, speculative=False)),
        ("in", [3, 4, 5, 6, 7] * 4, SamplingParams(temperature=0, max_tokens=40)),
    ]
    run_all(engine, reqs)
    rows = [(r.request_id, d) for out in runner.steps for r, d in zip(out.requests, out.drafts)]
    assert not any(d for rid, d in rows if rid == "out") and any(d for rid, d in rows if rid == "in")

    class NeverRunner(CopyRunner):  # takes a token other than the draft's first: every draft fails
        def execute(self, out):
            result = super().execute(out)
            for req, draft in zip(out.requests, out.drafts):
                if draft:
                    result.sampled[req.request_id] = [5 if draft[0] != 5 else 6]
            return result

    engine, _ = make_engine(SpecConfig("ngram", 4))
    engine.runner = runner = NeverRunner(4, vocab=40)
    run_all(engine, [("bad", [5, 6, 5, 6, 5, 6], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))])
    drafted_steps = [i for i, out in enumerate(runner.steps) if any(out.drafts)]
    # after a few failures only probes of one token, about every PROBE_EVERY steps
    late = [i for i in drafted_steps if i > 60]
    assert len(late) <= (len(runner.steps) - 60) // 10 + 1, drafted_steps
    assert all(len(d) <= 1 for out in runner.steps[60:] for d in out.drafts)


def test_the_timeline_marks_rows_that_took_several_tokens():
    engine, _ = make_engine(SpecConfig("ngram", 4))
    run_all(engine, [("a", [3, 4, 5, 6, 7] * 4, SamplingParams(temperature=0, max_tokens=40))])
    rows = [row for rec in engine.timeline.since(0) for row in rec.rows]
    verified = [row for row in rows if row[3] == "v"]
    assert verified and all(row[5] >= 1 and row[4] >= row[5] and row[2] == 1 + row[4] for row in verified)
    assert all(row[5] == 0 for row in rows if row[3] == "d")
    # the step stats carry the same counts
    engine, _ = make_engine(SpecConfig("ngram", 4))
    engine.add_request("a", [3, 4, 5, 6, 7] * 4, SamplingParams(temperature=0, max_tokens=40))
    stats = []
    while engine.has_work():
        _, s = engine.step()
        if s is not None:
            stats.append(s)
    assert sum(s.accepted_tokens for s in stats) == engine.spec.accepted > 0
    assert all(s.accepted_tokens <= s.draft_tokens for s in stats)


def test_a_new_request_starts_from_the_engines_recent_acceptance():
    from minibatch.engine.spec_decode.decoder import SpecDecoder

    spec = SpecDecoder(SpecConfig("ngram", 4))
    fresh = spec.engine_acceptance.rate
    engine, _ = make_engine(None)
    for i in range(40):  # drafts that keep failing, from other requests
        req = engine.add_request(f"x{i}", [3, 4, 5], SamplingParams(temperature=0, max_tokens=5))
        spec.observe(req, 4, 0)
    assert spec.engine_acceptance.rate < 0.25 < fresh
    req = engine.add_request("new", [3, 4, 5, 3, 4, 5], SamplingParams(temperature=0, max_tokens=20))
    req.output_token_ids.append(3)
    req.num_computed_tokens = req.num_tokens - 1
    spec.propose([req])  # at a low engine-wide rate: a probe of one token first ...
    assert len(req.draft_token_ids) == 1
    spec.observe(req, 1, 0)
    req.output_token_ids.append(4)
    req.num_computed_tokens = req.num_tokens - 1
    spec.propose([req])  # ... and after it failed, nothing until the next probe
    assert req.draft_token_ids == []


def test_a_draft_is_cut_to_what_its_source_has_been_accepted_for():
    """Two requests alike but for what found their drafts: one source's drafts have kept failing and the
    other's been taken whole, so the first's draft is cut short and the second's kept at full length."""
    from minibatch.engine.spec_decode.decoder import SpecDecoder
    from minibatch.engine.spec_decode.draft_length import Draft

    class TwoSources:
        def propose(self, reqs, ks):
            return [Draft([7] * k, "weak" if r.request_id == "a" else "strong") for r, k in zip(reqs, ks)]

        def forget(self, request_id):
            pass

    spec = SpecDecoder(SpecConfig("ngram", 8), proposer=TwoSources())
    engine, _ = make_engine(None)
    reqs = []
    for rid in ("a", "b"):
        req = engine.add_request(rid, [3, 4, 5], SamplingParams(temperature=0, max_tokens=50))
        req.output_token_ids.append(3)
        req.num_computed_tokens = req.num_tokens - 1
        reqs.append(req)
    spec.propose(reqs)  # both sources new: both drafts at the length the requests' own rates allow
    assert len(reqs[0].draft_token_ids) == len(reqs[1].draft_token_ids) > 1
    for _ in range(30):
        spec.observe(reqs[0], 1, 0)  # the weak source's drafts rejected at once ...
        spec.observe(reqs[1], 1, 1)  # ... the strong one's accepted
    spec._acceptance.clear()  # the requests start over from the engine's rate: only the sources differ
    spec.propose(reqs)
    weak, strong = (len(r.draft_token_ids) for r in reqs)
    assert spec.sources["weak"].rate < 0.2 < 0.9 < spec.sources["strong"].rate
    assert weak < strong and weak <= 1, (weak, strong)


def test_a_batch_too_large_for_drafts_gets_no_probes_but_a_failing_request_does():
    """Drafts that do not pay at this batch size are not tried now and then: the batch decides. A request
    whose drafts fail still tries one token every PROBE_EVERY steps, to learn whether it still fails."""
    from minibatch.engine.spec_decode.decoder import SpecDecoder
    from minibatch.engine.spec_decode.draft_length import PROBE_EVERY

    spec = SpecDecoder(SpecConfig("ngram", 4))
    spec.cost = StepCost(fixed=1e-3, per_token=1.0)  # a compute-bound step: no draft token pays
    engine, _ = make_engine(None)
    good = engine.add_request("good", [3, 4, 5, 3, 4, 5], SamplingParams(temperature=0, max_tokens=200))
    bad = engine.add_request("bad", [3, 4, 5, 3, 4, 5], SamplingParams(temperature=0, max_tokens=200))
    for req in (good, bad):
        req.output_token_ids.append(3)
        req.num_computed_tokens = req.num_tokens - 1
    spec.propose([good, bad])  # neither has verified yet: both probe once
    assert len(good.draft_token_ids) == len(bad.draft_token_ids) == 1
    for _ in range(20):
        spec.observe(good, 1, 1)
        spec.observe(bad, 1, 0)
    probes = {"good": 0, "bad": 0}
    for _ in range(4 * PROBE_EVERY):
        spec.propose([good, bad])
        for req in (good, bad):
            probes[req.request_id] += bool(req.draft_token_ids)
    assert probes == {"good": 0, "bad": 4}, probes

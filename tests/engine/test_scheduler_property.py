"""Property test: random arrivals, lengths, aborts and mode switches over a pool of a few blocks."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minibatch.engine.core.admission import RequestRejected
from minibatch.engine.core.request import RequestStatus
from minibatch.engine.core.sampling_params import SamplingParams

from .fakes import FakeRunner
from .test_scheduler import make

event = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12)),  # prompt length, max_tokens
    st.tuples(st.just("abort"), st.integers(0, 40), st.just(0)),
    st.tuples(st.just("mode"), st.sampled_from(["static", "continuous"]), st.just(0)),
    st.tuples(st.just("step"), st.integers(1, 4), st.just(0)),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    events=st.lists(event, min_size=1, max_size=60),
    num_blocks=st.integers(3, 12),
    block_size=st.sampled_from([2, 4]),
    seqs=st.integers(1, 4),
    budget_extra=st.integers(0, 12),
    start_mode=st.sampled_from(["continuous", "static"]),
    window=st.sampled_from([0, 0, 3, 5, 7, 9]),  # > 0: blocks out of the window are handed back early
)
def test_every_request_ends_and_no_block_leaks(events, num_blocks, block_size, seqs, budget_extra, start_mode, window):
    engine, runner, clock = make(
        num_blocks=num_blocks,
        block_size=block_size,
        seqs=seqs,
        budget=seqs + budget_extra,
        mode=start_mode,
        max_len=48,
        wait_ms=20,
        window=window,
    )
    reference = FakeRunner(block_size)
    added, rejected, finals = [], {}, {}

    def step():
        outs, _ = engine.step()
        engine.scheduler.blocks.check_integrity()
        clock.now += 0.005
        for o in outs:
            assert o.request_id not in finals, "a request finished twice"
            if o.finished:
                finals[o.request_id] = o

    for kind, a, b in events:
        if kind == "add":
            rid = f"r{len(added) + len(rejected)}"
            prompt = [(len(added) * 7 + i) % 40 + 3 for i in range(a)]
            try:
                added.append(
                    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=b, ignore_eos=True))
                )
            except RequestRejected as exc:
                assert str(exc)  # rejected with a reason
                rejected[rid] = str(exc)
        elif kind == "abort" and added:
            engine.abort(added[a % len(added)].request_id)
        elif kind == "mode":
            engine.set_mode(a)
        else:
            for _ in range(a):
                step()
    for _ in range(5000):
        if not engine.has_work():
            break
        step()
    assert not engine.has_work(), "requests never ended"

    bm = engine.scheduler.blocks
    assert bm.num_used_blocks == 0 and not bm.req_blocks, "blocks leaked"
    for req in added:
        out = finals[req.request_id]
        assert req.status.finished and out.finish_reason in ("length", "abort")
        if req.status == RequestStatus.FINISHED_LENGTH:
            # preempted or not, batched or not: the same tokens as computed alone
            toks = list(req.prompt_token_ids)
            for _ in range(req.params.max_tokens):
                toks.append(reference.next_token(toks))
            assert req.output_token_ids == toks[req.num_prompt_tokens :]


def test_the_property_run_exercises_preemption_and_static_padding():
    """Guard against a vacuous property test: the same setup does preempt and pad."""
    engine, runner, clock = make(num_blocks=5, block_size=2, seqs=3, budget=6, max_len=48, wait_ms=20)
    for i in range(4):
        engine.add_request(f"r{i}", [3 + i] * 3, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_work():
        engine.step()
        clock.now += 0.005
    assert engine.scheduler.num_preemptions > 0
    engine.set_mode("static")
    engine.add_request("s1", [3], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    engine.add_request("s2", [4], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    for _ in range(20):
        engine.step()
        clock.now += 0.005
    assert engine.scheduler.wasted_row_steps > 0


def test_the_property_run_exercises_window_release_with_preemption():
    """Guard against a vacuous window in the property test: blocks are handed back, under preemption too."""
    engine, runner, clock = make(num_blocks=10, block_size=2, seqs=4, budget=8, max_len=48, wait_ms=20, window=7)
    for i in range(5):
        engine.add_request(f"r{i}", [3 + i] * 5, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    while engine.has_work():
        engine.step()
        engine.scheduler.blocks.check_integrity()
        clock.now += 0.005
    bm = engine.scheduler.blocks
    assert bm.released_blocks > 0 and engine.scheduler.num_preemptions > 0
    assert bm.num_used_blocks == 0

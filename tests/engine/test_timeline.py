"""Step records with the fake runner: rows, states, static padding, continuous refill, preemption."""

from __future__ import annotations

import pytest

from minibatch.engine.core.timeline import Timeline

from .test_scheduler import make, params, run


def rows(rec) -> dict[int, tuple[str, int, str]]:
    return {row: (rid, n, state) for row, rid, n, state, *_ in rec.rows}


def test_continuous_refills_a_freed_row_at_the_next_step():
    engine, _, clock = make(seqs=2, budget=64)
    engine.add_request("a", [5, 6, 7], params(2))  # prefill + 1 decode
    engine.add_request("b", [8, 9], params(4))
    engine.add_request("c", [10, 11, 12, 13], params(2))
    run(engine, clock)
    recs = engine.timeline.since(0)
    assert [r.step for r in recs] == list(range(1, len(recs) + 1))
    # step 1: a and b prefill in rows 0 and 1 (3 and 2 tokens); c waits
    assert rows(recs[0]) == {0: ("a", 3, "p"), 1: ("b", 2, "p")} and recs[0].waiting == 1
    # step 2: both decode; a finishes (2 tokens)
    assert rows(recs[1]) == {0: ("a", 1, "d"), 1: ("b", 1, "d")}
    # step 3: c takes a's row 0 at once, next to b's decode
    assert rows(recs[2]) == {0: ("c", 4, "p"), 1: ("b", 1, "d")} and recs[2].waiting == 0
    assert all(r.mode == "continuous" and r.duration >= 0 for r in recs)
    assert recs[2].as_dict()["rows"] == [[0, "c", 4, "p", 0, 0], [1, "b", 1, "d", 0, 0]]


def test_static_keeps_finished_rows_as_padding_until_the_batch_ends():
    engine, _, clock = make(seqs=2, mode="static", budget=64)
    engine.add_request("short", [5, 6, 7], params(2))
    engine.add_request("long", [8, 9, 10], params(5))
    engine.add_request("late", [11, 12], params(1))
    run(engine, clock)
    recs = engine.timeline.since(0)
    first = recs[:5]
    assert [rows(r)[0][2] for r in first] == ["p", "d", "x", "x", "x"]  # short: prefill, decode, then padding
    assert [rows(r)[1][2] for r in first] == ["p", "d", "d", "d", "d"]
    assert all(r.waiting == 1 for r in first) and all(r.mode == "static" for r in recs)
    # the next batch: late gets row 0 only after the whole first batch left
    assert rows(recs[5]) == {0: ("late", 2, "p")}


def test_preemption_is_marked_and_the_row_given_back():
    engine, runner, clock = make(num_blocks=7, block_size=4, budget=32)
    engine.add_request("a", list(range(3, 11)), params(8))
    engine.add_request("b", list(range(20, 28)), params(8))
    run(engine, clock)
    recs = engine.timeline.since(0)
    hit = [r for r in recs if r.preempted]
    assert hit and all(r.preempted == ("b",) for r in hit)
    first = hit[0]
    assert "b" not in {rid for _, rid, *_ in first.rows}  # sent back to the queue: no row this step
    assert first.waiting >= 1
    later = recs[recs.index(first) + 1 :]
    back = next(r for r in later if "b" in {rid for _, rid, *_ in r.rows})
    assert rows(back)[[row for row, rid, *_ in back.rows if rid == "b"][0]][2] == "p"  # recomputed as a prefill


def test_the_ring_keeps_the_last_n_steps_and_since_filters():
    engine, _, clock = make(seqs=4, budget=64)
    engine.timeline = Timeline(5)
    engine.add_request("a", [5, 6], params(12))
    run(engine, clock)
    recs = engine.timeline.since(0)
    assert len(recs) == 5 and recs[-1].step == engine.num_steps == engine.timeline.last_step
    assert [r.step for r in engine.timeline.since(engine.num_steps - 2)] == [engine.num_steps - 1, engine.num_steps]
    with pytest.raises(ValueError, match="at least 1"):
        Timeline(0)

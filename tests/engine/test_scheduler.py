"""Schedulers with a fake runner: chunked prefill, preemption, static batches, mode switches, rejection."""

from __future__ import annotations

import subprocess
import sys

import pytest

from minibatch.engine.core.admission import QueueFull, RequestRejected
from minibatch.engine.core.block_manager import BlockManager
from minibatch.engine.core.config import SchedulerConfig
from minibatch.engine.core.engine import LLMEngine
from minibatch.engine.core.request import RequestStatus
from minibatch.engine.core.sampling_params import SamplingParams

from .fakes import CharTokenizer, Clock, FakeRunner


def make(
    num_blocks=64, block_size=4, seqs=4, budget=16, mode="continuous", max_len=256, wait_ms=50.0, queue=None, window=0
):
    clock = Clock()
    runner = FakeRunner(block_size, window=window)
    engine = LLMEngine(
        runner,
        CharTokenizer(),
        BlockManager(num_blocks, block_size, window=window),
        SchedulerConfig(seqs, budget, max_len, wait_ms, queue),
        eos_token_ids=(2,),
        mode=mode,
        clock=clock,
    )
    return engine, runner, clock


def params(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def run(engine, clock=None, max_steps=1000):
    """Step until idle; check block integrity after every step; return final outputs by id."""
    finals, texts = {}, {}
    for _ in range(max_steps):
        if not engine.has_work():
            break
        outs, _ = engine.step()
        engine.scheduler.blocks.check_integrity()
        for o in outs:
            texts[o.request_id] = texts.get(o.request_id, "") + o.text
            if o.finished:
                finals[o.request_id] = o
        if clock is not None:
            clock.now += 0.01
    assert not engine.has_work()
    return finals, texts


def solo_output(prompt, n, **kw):
    engine, _, clock = make(**kw)
    req = engine.add_request("solo", prompt, params(n))
    run(engine, clock)
    return req.output_token_ids


def test_engine_core_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import minibatch.engine.core.block_manager, minibatch.engine.core.scheduler, minibatch.engine.core.engine\n"
        "import minibatch.engine.async_engine\n"
        "import minibatch.engine.core.policies.continuous, minibatch.engine.core.policies.static\n"
        "import minibatch.engine.core.timeline, minibatch.engine.core.scheduler_output\n"
        "import minibatch.engine.core.detokenizer\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_chunked_prefill_splits_by_token_budget():
    engine, runner, _ = make(budget=8)
    engine.add_request("a", list(range(3, 23)), params(2))  # 20 prompt tokens
    run(engine)
    steps = [(s.num_new_tokens, s.num_prefill_tokens, s.num_decode_tokens) for s in runner.steps]
    assert steps == [([8], 8, 0), ([8], 8, 0), ([4], 4, 0), ([1], 0, 1)]


def test_whole_prompts_are_never_chunked_and_wait_for_a_step_with_room():
    """An encoder's inputs (whole_prompts): 12 + 12 tokens in a 20-token budget go in two steps, whole."""
    clock = Clock()
    runner = FakeRunner(4)
    engine = LLMEngine(
        runner,
        CharTokenizer(),
        BlockManager(64, 4, enable_prefix_caching=False),
        SchedulerConfig(4, 20, 256, whole_prompts=True),
        mode="continuous",
        clock=clock,
    )
    for rid in "ab":
        engine.add_request(rid, list(range(3, 15)), params(1), pooling="mean")
    run(engine)
    assert [(s.num_new_tokens, [r.request_id for r in s.requests]) for s in runner.steps] == [
        ([12], ["a"]),
        ([12], ["b"]),
    ]


def test_decodes_go_first_and_prefill_chunks_fill_the_rest():
    engine, runner, _ = make(budget=8)
    engine.add_request("a", list(range(3, 8)), params(4))  # 5 tokens: prefilled in step 1
    engine.step()
    engine.add_request("b", list(range(3, 23)), params(2))  # 20 tokens
    engine.step()
    s = runner.steps[-1]
    assert [r.request_id for r in s.requests] == ["a", "b"] and s.num_new_tokens == [1, 7]
    assert (s.num_decode_tokens, s.num_prefill_tokens) == (1, 7)


def test_max_num_seqs_caps_the_running_set():
    engine, runner, _ = make(seqs=2, budget=64)
    for i in range(3):
        engine.add_request(f"r{i}", [5, 6, 7], params(3))
    engine.step()
    assert [r.request_id for r in runner.steps[0].requests] == ["r0", "r1"]
    assert [r.request_id for r in engine.scheduler.waiting] == ["r2"]
    run(engine)


def test_preemption_takes_the_newest_and_recomputes_it_exactly():
    # 6 usable blocks of 4 tokens; two requests growing to 16 tokens each cannot both fit.
    engine, runner, _ = make(num_blocks=7, block_size=4, budget=32)
    a = engine.add_request("a", list(range(3, 11)), params(8))
    b = engine.add_request("b", list(range(20, 28)), params(8))
    finals, _ = run(engine)
    preempted = [r.request_id for s in runner.steps for r in s.preempted]
    assert preempted and set(preempted) == {"b"}  # always the most recently admitted
    assert b.num_preemptions == len(preempted) and a.num_preemptions == 0
    assert finals["a"].finish_reason == finals["b"].finish_reason == "length"
    assert a.output_token_ids == solo_output(list(range(3, 11)), 8)
    assert b.output_token_ids == solo_output(list(range(20, 28)), 8)
    assert engine.scheduler.blocks.num_used_blocks == 0


def test_prefix_cache_hit_skips_cached_prompt_blocks():
    engine, runner, _ = make(block_size=4, budget=64)
    history = list(range(3, 15))  # 12 tokens = 3 blocks
    engine.add_request("turn1", history, params(2))
    run(engine)
    second = engine.add_request("turn2", history + [40, 41, 42], params(2))
    run(engine)
    assert second.num_cached_tokens == 12
    assert runner.steps[-2].prefix_hit_blocks == 3 and runner.steps[-2].num_new_tokens == [3]
    assert second.output_token_ids == solo_output(history + [40, 41, 42], 2)


@pytest.mark.parametrize("mode", ["continuous", "static"])
def test_a_request_that_ends_at_its_first_token_leaves_its_prompt_cached(mode):
    """Its prompt's full blocks are registered before they are freed: a later prompt finds them."""
    engine, runner, clock = make(block_size=4, budget=64, mode=mode)
    history = list(range(3, 15))  # 12 tokens = 3 blocks
    engine.add_request("once", history, params(1))
    run(engine, clock)
    again = engine.add_request("again", history + [40], params(2))
    run(engine, clock)
    assert again.num_cached_tokens == 12 and again.output_token_ids == solo_output(history + [40], 2)
    assert engine.scheduler.blocks.num_used_blocks == 0


def test_static_batch_no_join_and_early_finisher_returns_at_once():
    engine, runner, clock = make(seqs=2, mode="static", budget=64)
    engine.add_request("short", [5, 6, 7], params(2))
    engine.add_request("long", [8, 9, 10], params(5))
    engine.add_request("late", [11, 12], params(1))
    finished_at = {}
    step = 0
    while engine.has_work():
        outs, stats = engine.step()
        engine.scheduler.blocks.check_integrity()
        step += 1
        for o in outs:
            if o.finished:
                finished_at[o.request_id] = step
        clock.now += 0.01
    first_batch = runner.steps[:5]
    # the batch of two ran 5 steps; "late" never joined it although "short" was done after step 2
    assert all({r.request_id for r in s.requests} <= {"short", "long"} for s in first_batch)
    assert finished_at["short"] == 2 and finished_at["long"] == 5 and finished_at["late"] > 5
    # "short"'s row kept being computed as padding for steps 3..5
    assert [len(s.padding) for s in first_batch] == [0, 0, 1, 1, 1]
    assert engine.scheduler.wasted_row_steps == 3


def test_static_batch_waits_for_max_num_seqs_or_max_wait():
    engine, runner, clock = make(seqs=3, mode="static", wait_ms=100)
    engine.add_request("a", [5, 6], params(1))
    outs, stats = engine.step()
    assert stats is None and not runner.steps  # not full, not old enough
    assert engine.scheduler.next_wakeup() == pytest.approx(1000.1)
    clock.now += 0.1
    engine.step()
    assert [r.request_id for r in runner.steps[0].requests] == ["a"]


def test_mode_switch_waits_for_the_batch_boundary():
    engine, runner, clock = make(seqs=2, mode="continuous", budget=64)
    a = engine.add_request("a", [5, 6, 7], params(4))
    engine.step()
    engine.set_mode("static")
    engine.add_request("b", [8, 9], params(2))
    engine.step()
    assert engine.mode == "continuous" and engine.scheduler.pending_mode == "static"
    assert [r.request_id for r in runner.steps[-1].requests] == ["a"]  # b not admitted while draining
    finals, _ = run(engine, clock)
    assert engine.mode == "static" and len(a.output_token_ids) == 4 and finals["b"].finish_reason == "length"
    # and back: the static batch finishes before continuous takes over
    engine.add_request("c", [5], params(3))
    engine.add_request("d", [6], params(3))
    engine.step()
    engine.set_mode("continuous")
    engine.step()
    assert engine.mode == "static"
    run(engine, clock)
    assert engine.mode == "continuous"


def test_rejections_name_the_limit():
    engine, _, _ = make(num_blocks=5, block_size=4, max_len=64)
    with pytest.raises(RequestRejected, match=r"60 tokens\) \+ max_tokens \(5\) = 65 exceeds the context limit of 64"):
        engine.add_request("long", [5] * 60, params(5))
    with pytest.raises(RequestRejected, match="needs 5 KV blocks but the whole cache has 4"):
        engine.add_request("big", [5] * 17, params(3))
    with pytest.raises(RequestRejected, match="prompt is empty"):
        engine.add_request("empty", [], params(3))
    with pytest.raises(RequestRejected, match="the prompt has 64 tokens; the context limit is 64") as refused:
        engine.add_request("whole", [5] * 64, params(1))
    assert (refused.value.field, refused.value.code, refused.value.status) == ("prompt", "context_length_exceeded", 400)
    assert engine.add_request("fits", [5] * 13, params(3)).status == RequestStatus.WAITING


def test_queue_cap():
    # max_queue is what may wait behind a full batch: max_num_seqs (4) + max_queue (2) in flight at most.
    engine, _, _ = make(queue=2)
    for i in range(6):
        engine.add_request(f"r{i}", [5], params(3))
    with pytest.raises(QueueFull, match="waiting queue is full") as refused:
        engine.add_request("late", [5], params(3))
    assert (refused.value.status, refused.value.code, refused.value.field) == (429, "queue_full", None)
    engine.step()
    assert len(engine.scheduler.running) == 4 and len(engine.scheduler.waiting) == 2
    with pytest.raises(QueueFull):
        engine.add_request("late", [5], params(3))
    while engine.has_work():
        engine.step()
    engine.add_request("late", [5], params(3))  # room again once the batch is done


@pytest.mark.parametrize("where", ["waiting", "running", "preempted"])
def test_abort_in_every_state_frees_blocks(where):
    engine, runner, _ = make(num_blocks=7, block_size=4, budget=32, seqs=2 if where != "waiting" else 1)
    engine.add_request("a", list(range(3, 11)), params(8))
    engine.add_request("b", list(range(20, 28)), params(8))
    target = {"waiting": "b", "running": "a", "preempted": "b"}[where]
    for _ in range(50):
        r = engine.scheduler.requests[target]
        state = {
            "waiting": RequestStatus.WAITING,
            "running": RequestStatus.RUNNING,
            "preempted": RequestStatus.PREEMPTED,
        }
        if r.status == state[where]:
            break
        engine.step()
    assert r.status == state[where]
    assert engine.abort(target)
    finals, _ = run(engine)
    assert finals[target].finish_reason == "abort"
    assert engine.scheduler.blocks.num_used_blocks == 0
    if where == "waiting":
        assert all(target not in [q.request_id for q in s.requests] for s in runner.steps)


def test_stop_strings_token_ids_and_eos():
    engine, runner, _ = make()
    tok = CharTokenizer()
    prompt = [5, 6, 7]
    full = solo_output(prompt, 12)
    text = tok.decode(full)
    stop = text[5:7]  # two letters spanning two tokens
    engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=12, stop=[stop]))
    engine.add_request("t", prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[full[3]]))
    finals, texts = run(engine)
    assert texts["s"] == text[: text.index(stop)] and finals["s"].finish_reason == "stop"
    assert texts["t"] == tok.decode(full[: full.index(full[3])]) and finals["t"].finish_reason == "stop"


def test_sampling_params_bound_top_k():
    from minibatch.engine.core.sampling_params import InvalidParameterError

    with pytest.raises(InvalidParameterError, match=r"top_k: must be in \[-1, 1000000\]"):
        SamplingParams(top_k=2**64)

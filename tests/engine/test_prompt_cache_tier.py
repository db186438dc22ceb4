"""The scheduler's second tier with a fake tier: a request waits off the queue while its blocks load, the others
keep stepping, an abort during a load frees nothing before the reads end, and salts keep namespaces apart."""

from __future__ import annotations

from minibatch.engine.core.block_manager import BlockManager, block_hash
from minibatch.engine.core.config import SchedulerConfig
from minibatch.engine.core.engine import LLMEngine
from minibatch.engine.core.kv_tier import BlockKey, TierCounters
from minibatch.engine.core.request import RequestStatus
from minibatch.engine.core.sampling_params import SamplingParams

from .fakes import CharTokenizer, Clock, FakeRunner

BS = 4


class FakeTier:
    """Holds the keys it was given; a load ends when the test releases it, with as many blocks intact as set."""

    identity = "fake"

    def __init__(self, min_blocks: int = 1) -> None:
        self.min_blocks = min_blocks
        self.held: set[int] = set()
        self.saved: list[BlockKey] = []
        self.loads: dict[str, tuple[list[BlockKey], list[int]]] = {}
        self.released: dict[str, int] = {}

    def match(self, keys) -> int:
        n = 0
        for k in keys:
            if k.hash not in self.held:
                break
            n += 1
        return n

    def load(self, request_id, keys, block_ids) -> None:
        self.loads[request_id] = (list(keys), list(block_ids))

    def release(self, request_id: str, intact: int | None = None) -> None:
        self.released[request_id] = len(self.loads[request_id][0]) if intact is None else intact

    def poll(self):
        out = [(rid, n) for rid, n in self.released.items()]
        for rid, _ in out:
            del self.released[rid], self.loads[rid]
        return out

    def save(self, blocks) -> None:
        for key, _ in blocks:
            self.saved.append(key)
            self.held.add(key.hash)

    def counters(self) -> TierCounters:
        return TierCounters()

    def close(self) -> None:
        pass


def make(tier: FakeTier, num_blocks: int = 64):
    runner = FakeRunner(BS)
    engine = LLMEngine(
        runner,
        CharTokenizer(),
        BlockManager(num_blocks, BS),
        SchedulerConfig(4, 64, 256, 50.0, None),
        eos_token_ids=(2,),
        clock=Clock(),
        tier=tier,
    )
    return engine, runner


def params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def drain(engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step()[0]:
            out.setdefault(o.request_id, []).extend(o.token_ids)
    engine.scheduler.blocks.check_integrity()
    return out


PROMPT = list(range(3, 3 + 23))  # five full blocks before the last token's


def restarted(max_tokens: int, min_blocks: int = 1) -> tuple[FakeTier, list[int]]:
    """PROMPT answered by a first engine: a new tier holding every block it registered (as after a restart:
    the pool empty, the tier full), and the answer's tokens."""
    first = FakeTier()
    engine, _ = make(first)
    engine.add_request("a", PROMPT, params(max_tokens))
    want = drain(engine)["a"]
    tier = FakeTier(min_blocks)
    tier.held = set(first.held)
    return tier, want


def test_registered_blocks_are_offered_to_the_tier_with_their_chained_keys():
    tier = FakeTier()
    engine, _ = make(tier)
    engine.add_request("a", PROMPT, params(2))
    out = drain(engine)["a"]
    parent = 0
    want = []
    seq = PROMPT + out
    for i in range(len(PROMPT) // BS + 1):  # the prompt's five full blocks, and a sixth its first token fills
        tokens = tuple(seq[i * BS : (i + 1) * BS])
        h = block_hash(parent, tokens)
        want.append(BlockKey(h, parent, tokens))
        parent = h
    assert tier.saved == want


def test_a_request_waits_off_the_queue_for_its_blocks_while_another_steps_and_answers_the_same():
    tier, want = restarted(4)
    engine, runner = make(tier)
    engine.add_request("a", PROMPT, params(4))
    engine.add_request("b", [7, 8, 9], params(6))
    engine.step()
    assert "a" in engine.scheduler.loading and len(tier.loads["a"][0]) == 5  # every full block but the last's
    steps = 0
    while "b" in engine.scheduler.requests and steps < 3:  # b decodes while a's blocks come in
        engine.step()
        steps += 1
    assert steps == 3 and all(r.request_id == "b" for s in runner.steps for r in s.requests)
    tier.release("a")
    out = drain(engine)
    assert out["a"] == want
    admitted = next(s for s in runner.steps if any(r.request_id == "a" for r in s.requests))
    row = [r.request_id for r in admitted.requests].index("a")
    assert admitted.num_new_tokens[row] == len(PROMPT) - 5 * BS  # only the last, partial block computed
    assert engine.state().disk_hit_blocks == 5


def test_a_torn_block_ends_the_hit_there_and_the_rest_is_recomputed():
    tier2, want = restarted(3)
    engine, runner = make(tier2)
    engine.add_request("a", PROMPT, params(3))
    engine.step()
    tier2.release("a", intact=2)
    out = drain(engine)
    assert out["a"] == want
    assert engine.state().disk_hit_blocks == 2
    first = next(s for s in runner.steps if s.requests)
    assert first.num_new_tokens[0] == len(PROMPT) - 2 * BS


def test_an_abort_while_loading_frees_the_blocks_only_once_the_reads_end():
    tier2, _ = restarted(2)
    engine, _ = make(tier2)
    engine.add_request("a", PROMPT, params(2))
    engine.step()
    bm = engine.scheduler.blocks
    held = bm.num_used_blocks
    assert held == 5
    engine.abort("a")
    engine.step()
    assert bm.num_used_blocks == held  # the tier may still be writing into them
    tier2.release("a")
    engine.step()
    assert bm.num_used_blocks == 0 and not engine.has_work()
    bm.check_integrity()


def test_a_run_shorter_than_the_crossover_is_recomputed():
    tier2, _ = restarted(2, min_blocks=6)
    engine, _ = make(tier2)
    engine.add_request("a", PROMPT, params(2))
    engine.step()
    assert not engine.scheduler.loading and not tier2.loads
    drain(engine)


def test_salts_keep_the_prefix_caches_apart():
    tier = FakeTier()
    engine, runner = make(tier)
    engine.add_request("a", PROMPT, params(2), cache_salt=1)
    drain(engine)
    engine.add_request("b", PROMPT, params(2), cache_salt=2)
    engine.add_request("c", PROMPT, params(2), cache_salt=1)
    drain(engine)
    by_id = {}
    for s in runner.steps:
        for r, n in zip(s.requests, s.num_new_tokens):
            by_id.setdefault(r.request_id, n)
    assert by_id["b"] == len(PROMPT)  # another salt: nothing shared, in memory or in the tier
    assert by_id["c"] == len(PROMPT) - 5 * BS  # its own salt's blocks are hits
    assert not engine.scheduler.loading
    roots = {k.parent for k in tier.saved if k.tokens == tuple(PROMPT[:BS])}
    assert roots == {1, 2}


def test_the_status_of_a_loading_request_is_waiting_until_it_runs():
    tier2, _ = restarted(2)
    engine, _ = make(tier2)
    req = engine.add_request("a", PROMPT, params(2))
    engine.step()
    assert req.status == RequestStatus.WAITING and engine.scheduler.num_unfinished == 1
    tier2.release("a")
    drain(engine)
    assert req.status.finished and req.num_disk_cached_tokens == 5 * BS == req.num_cached_tokens


def test_pool_hits_and_disk_hits_make_one_prefix_and_each_block_counts_once():
    tier, _ = restarted(2)
    h0 = block_hash(0, tuple(PROMPT[:BS]))
    tier.held -= {h0, block_hash(h0, tuple(PROMPT[BS : 2 * BS]))}  # the tier lacks the first two
    engine, runner = make(tier)
    engine.add_request("short", PROMPT[:9], params(1))  # computes them: they stay in the pool
    drain(engine)
    engine.add_request("a", PROMPT, params(2))
    engine.step()
    assert len(tier.loads["a"][0]) == 3  # the pool has the first two; the tier reads the next three
    tier.release("a")
    drain(engine)
    st = engine.state()
    assert st.disk_hit_blocks == 3 and st.prefix_cache_hit_blocks == 5  # each block counted once
    first_row = next(s for s in runner.steps if any(r.request_id == "a" for r in s.requests))
    assert first_row.num_new_tokens[[r.request_id for r in first_row.requests].index("a")] == len(PROMPT) - 5 * BS

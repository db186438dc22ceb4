"""BlockManager: exact block ids, free-queue order, reference counts and prefix caching on a tiny pool."""

from __future__ import annotations

import pytest

from minibatch.engine.core.block_manager import BlockManager
from minibatch.engine.core.request import Request
from minibatch.engine.core.sampling_params import SamplingParams


def req(rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens))


def computed(r: Request, n: int) -> Request:
    r.num_computed_tokens = n
    return r


def test_allocation_order_and_reverse_freeing():
    bm = BlockManager(num_blocks=8, block_size=4)  # block 0 is the null block: 7 usable
    a, b = req("a", list(range(10))), req("b", list(range(100, 105)))
    assert bm.allocate(a, 10) and a.block_ids == [1, 2, 3]
    assert bm.allocate(b, 5) and b.block_ids == [4, 5]
    assert bm.num_free_blocks == 2 and bm.usage == pytest.approx(5 / 7)
    bm.free(a)
    # nothing of a's is cached: its blocks are handed out again first, before the pool's never-written ones
    assert list(bm.free_queue) == [1, 2, 3, 6, 7]
    bm.check_integrity()


def test_cached_blocks_wait_at_the_tail_and_a_reused_pool_stays_small():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req("a", list(range(10)))
    assert bm.allocate(a, 10) and a.block_ids == [1, 2, 3]
    bm.cache_full_blocks(computed(a, 10))  # blocks 1 and 2 full: they can be hit
    bm.free(a)
    # the partial block first; the cached ones last, a's tail evicted before its head
    assert list(bm.free_queue) == [3, 4, 5, 6, 7, 2, 1]
    bm.check_integrity()
    # one request after another without caching: they take the same few blocks, never the rest of the pool
    plain = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    for i in range(20):
        r = req(f"r{i}", list(range(6)))
        assert plain.allocate(r, 6) and set(r.block_ids) <= {1, 2}
        plain.free(r)
    plain.check_integrity()


def test_allocate_refuses_without_changing_anything():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = req("a", list(range(12)))
    assert not bm.allocate(a, 13)
    assert bm.num_free_blocks == 3 and a.block_ids == [] and "a" not in bm.req_blocks
    assert bm.allocate(a, 12) and a.block_ids == [1, 2, 3]
    bm.check_integrity()


def test_growing_a_request_one_token_at_a_time():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = req("a", list(range(4)))
    assert bm.allocate(a, 4) and a.block_ids == [1]
    computed(a, 4)
    a.output_token_ids.append(9)
    assert bm.allocate(a, 1) and a.block_ids == [1, 2]  # the 5th token needs a second block
    computed(a, 5)
    a.output_token_ids.append(9)
    assert bm.allocate(a, 1) and a.block_ids == [1, 2]
    bm.check_integrity()


def test_prefix_hit_shares_blocks_and_counts_references():
    bm = BlockManager(num_blocks=10, block_size=4)
    shared = list(range(1, 9))  # two full blocks
    a = req("a", shared + [50, 51])
    assert bm.allocate(a, 10)
    bm.cache_full_blocks(computed(a, 10))
    b = req("b", shared + [60])
    hits = bm.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [1, 2]
    assert bm.allocate(b, 1, hits) and b.block_ids == [1, 2, 4]
    assert [bm.blocks[i].ref_count for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    bm.check_integrity()
    bm.free(a)
    assert bm.blocks[1].ref_count == 1 and 1 not in bm.free_queue and 3 in bm.free_queue
    bm.check_integrity()


def test_freed_cached_blocks_hit_until_evicted():
    bm = BlockManager(num_blocks=5, block_size=4)  # 4 usable
    a = req("a", list(range(1, 9)) + [7])
    assert bm.allocate(a, 9)  # blocks 1, 2, 3
    bm.cache_full_blocks(computed(a, 9))
    bm.free(a)
    assert list(bm.free_queue) == [3, 4, 2, 1]  # block 3 holds a partial block: nothing to hit, first out
    again = req("again", list(range(1, 9)) + [8])
    assert [h.block_id for h in bm.get_computed_blocks(again)] == [1, 2]
    # Take three blocks: 3, 4 and then 2, which evicts the second cached block.
    other = req("other", list(range(200, 212)))
    assert bm.allocate(other, 12) and other.block_ids == [3, 4, 2]
    assert [h.block_id for h in bm.get_computed_blocks(again)] == [1]  # only the first block survives
    bm.check_integrity()


def test_whole_prompt_is_never_a_hit():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = req("a", list(range(1, 9)))
    assert bm.allocate(a, 8)
    bm.cache_full_blocks(computed(a, 8))
    same = req("same", list(range(1, 9)))
    # 8 tokens, both blocks cached: one block is still recomputed to get logits
    assert [h.block_id for h in bm.get_computed_blocks(same)] == [1]


def test_hash_chain_depends_on_the_parent():
    bm = BlockManager(num_blocks=10, block_size=2)
    a = req("a", [1, 2, 3, 4, 5])
    assert bm.allocate(a, 5)
    bm.cache_full_blocks(computed(a, 5))
    # Same second block [3, 4] after a different first block: no hit past the first.
    b = req("b", [9, 9, 3, 4, 5])
    assert bm.get_computed_blocks(b) == []


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    a = req("a", list(range(1, 10)))
    assert bm.allocate(a, 9)
    bm.cache_full_blocks(computed(a, 9))
    assert bm.get_computed_blocks(req("b", list(range(1, 10)))) == [] and not bm.cached


def test_blocks_out_of_the_sliding_window_are_handed_back():
    bm = BlockManager(num_blocks=12, block_size=4, window=6)
    a = req("a", list(range(10)), max_tokens=20)
    assert bm.allocate(a, 10) and a.block_ids == [1, 2, 3]
    computed(a, 10)
    bm.cache_full_blocks(a)
    # the next query (position 10) sees positions 5..10: block 1 (0..3) is out; block 2 (4..7) is not,
    # and it is also the last registered block, which the next hash chains from
    assert bm.release_out_of_window(a) == 1
    assert a.block_ids == [0, 2, 3] and bm.num_free_blocks == 9 and list(bm.free_queue)[-1] == 1
    bm.check_integrity()
    a.output_token_ids = list(range(100, 110))  # it decodes on, one block at a time
    for n in range(11, 21):
        assert bm.allocate(a, 1)
        computed(a, n)
        bm.cache_full_blocks(a)
        bm.release_out_of_window(a)
        bm.check_integrity()
    # 20 tokens computed: position 20 sees 15..20, blocks 0..2 (positions 0..11) are out, 3 is kept to chain
    assert a.block_ids[:3] == [0, 0, 0] and 0 not in a.block_ids[3:]
    assert bm.released_blocks == 3 and bm.num_used_blocks == len(a.block_ids) - 3
    # a released block keeps its hash: a new request with the same start still hits it
    b = req("b", list(range(8)) + [99])
    assert [blk.block_id for blk in bm.get_computed_blocks(b)] == [1, 2]
    bm.free(a)
    assert bm.num_used_blocks == 0
    bm.check_integrity()


def test_without_prefix_caching_every_block_out_of_the_window_goes():
    bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=False, window=4)
    a = req("a", list(range(13)))
    assert bm.allocate(a, 13)
    computed(a, 13)
    assert bm.release_out_of_window(a) == 2 and a.block_ids[:2] == [0, 0]  # position 13 sees 10..13
    assert bm.release_out_of_window(a) == 0
    bm.free(a)
    assert bm.num_used_blocks == 0
    bm.check_integrity()

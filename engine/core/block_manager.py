"""KV-cache block bookkeeping: a free queue, reference counts and prefix caching. Pure Python.

Block 0 is reserved as the null block: it is never handed out, so padding in a
block table or slot mapping can point at it without a sentinel value.

Prefix caching: a block whose 16 (block_size) tokens are all computed gets a
hash chained from its parent block's hash and its own token ids (`block_hash`:
BLAKE2b, the same in every process, so the disk tier, kv_tier.py, files blocks
by it; a request's first block chains from its `cache_salt`, so requests of
different salts never share a block). A later
request whose prompt starts with the same tokens shares those blocks (the
reference count goes up) instead of recomputing them. A freed block keeps its
hash while it sits in the free queue, so it can still be hit until it is
evicted by being handed out again.

The free queue is least-recently-freed first. A request's blocks are freed in
reverse order, so its tail blocks (least likely to be shared) are evicted
before the head of its prompt. A freed block that holds no cached contents (a
partial block, or any block with prefix caching off) goes to the front
instead: it is the next one handed out, so the blocks in use stay the few the
load needs and the rest of the pool is never written (on the CPU the pool's
pages cost memory only once written: cycling through every block put all of
it in the daemon's resident memory), and cached blocks live longer.

Sliding windows: when every layer of the model attends to the last `window`
positions only, a block wholly before the window of a request's next token is
never read again. `release_out_of_window` hands it back early (it keeps its
hash, so it can still be a prefix hit) and puts the null block in its place in
the request's table; the attention paths mask those positions anyway.

Shifted reuse (kv_reuse.py): a request that allows it may start with rows copied from a recent prompt's
blocks, K rotated to new positions. Such a request's blocks from the first reused one on are registered under
a chain rooted in a nonce of its own (`req_approx`), so no exact lookup ever finds them and the disk tier is
not offered them; the finished request is kept as a `ReuseSource` for the next one of its salt. Blocks rows
are copied from are pinned (`pin`) until the step that copies them has run.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass

from minibatch.engine.core.kv_reuse import ReusePlan, ReuseSource, Run, plan_runs
from minibatch.engine.core.kv_tier import BlockKey
from minibatch.engine.core.request import Request, RequestStatus

NULL_BLOCK = 0
HASH_MASK = (1 << 64) - 1
REUSE_SOURCES = 8  # recent prompts of each salt kept to reuse shifted runs from


def block_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """The chained hash of a block holding `tokens` after the block hashed `parent` (the first block's
    parent is its request's cache salt): 64 bits of BLAKE2b, the same in every process and on every machine.
    A hit is still checked against the block's own tokens and parent, so a collision is a miss."""
    data = parent.to_bytes(8, "little") + array("i", tokens).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and registered
    parent_hash: int | None = None  # (the first block's: its request's cache salt)
    token_ids: tuple[int, ...] | None = None  # kept to verify a hash hit


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, window: int = 0) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (one is the null block), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window  # > 0: every layer sees the last `window` positions only (release_out_of_window)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self.cached: dict[int, Block] = {}  # block hash -> block holding those tokens
        self.req_blocks: dict[str, list[Block]] = {}
        self.req_num_hashed: dict[str, int] = {}  # leading blocks of a request already registered
        self.req_num_released: dict[str, int] = {}  # leading blocks handed back as out of the window
        self.released_blocks = 0  # blocks handed back early, over the manager's life
        self.prefix_hits = 0  # blocks served from the cache, over the manager's life
        # Blocks registered since the engine last took them (`take_registered`), for a second tier to keep;
        # None: nobody keeps them.
        self.registered: list[tuple[BlockKey, int]] | None = None
        # Shifted reuse: recent prompts per salt (newest last); per request, its first block whose contents
        # came from (or follow) shifted rows and the nonce its chain restarts from there; pinned source blocks
        self.reuse_sources: dict[int, deque[ReuseSource]] = {}
        self.req_approx: dict[str, tuple[int, int]] = {}
        self.pinned: list[Block] = []
        self._nonce = 0

    # -- capacity ---------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_usable_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache and shared prompts ------------------------------------
    def shared_prompt_blocks(self, req: Request) -> int:
        """How many full prompt blocks a sibling of an n > 1 request borrows from its leader (0 without one).

        The last prompt token is always computed by each sibling itself, so it gets its own next-token logits
        and writes its own tail block: sharing full blocks only, nothing is ever written twice."""
        return 0 if req.prompt_leader is None else (req.num_prompt_tokens - 1) // self.block_size

    def leader_blocks(self, req: Request) -> list[Block] | None:
        """The leader's computed prompt blocks to share; None while the running leader is still computing
        them (the sibling waits for it); [] when there is nothing to share: no leader, a short prompt, or a
        leader not running (finished, or preempted -- waiting for it then could deadlock the queue)."""
        k = self.shared_prompt_blocks(req)
        leader = req.prompt_leader
        if k == 0 or leader.status != RequestStatus.RUNNING or self.req_num_released.get(leader.request_id):
            return []  # (a leader past its window has handed back the start of its prompt)
        if leader.num_computed_tokens < k * self.block_size:
            return None
        return self.req_blocks[leader.request_id][:k]

    def get_computed_blocks(self, req: Request) -> list[Block]:
        """The longest run of cached full blocks that starts the request's tokens.

        At least one token is always left to compute, so the forward has a
        position to take the next token's logits from.
        """
        shared = self.leader_blocks(req) if req.prompt_leader is not None else []
        if shared:
            return shared
        if not self.enable_prefix_caching or req.computes_every_position:
            return []
        hits: list[Block] = []
        for key in self.chain(req):
            block = self.cached.get(key.hash)
            if block is None or block.token_ids != key.tokens or block.parent_hash != key.parent:
                break
            hits.append(block)
        return hits

    def chain(self, req: Request, start: int = 0, parent: int | None = None) -> Iterator[BlockKey]:
        """The keys of the request's full blocks from block `start` (whose parent's hash is `parent`; from 0,
        the request's salt), up to the last that leaves a token to compute."""
        parent = req.cache_salt if parent is None else parent
        for i in range(start, (req.num_tokens - 1) // self.block_size):
            tokens = req.key_tokens(i * self.block_size, (i + 1) * self.block_size)
            h = block_hash(parent, tokens)
            yield BlockKey(h, parent, tokens)
            parent = h

    def register_loaded(self, req: Request, keys: list[BlockKey]) -> None:
        """The request's blocks after its computed ones now hold these keys' contents (read from a second
        tier): register them as if computed, so its admission finds them as prefix hits."""
        blocks = self.req_blocks.get(req.request_id, [])
        start = self.req_num_hashed.get(req.request_id, 0)
        for block, key in zip(blocks[start:], keys):
            block.block_hash, block.parent_hash, block.token_ids = key.hash, key.parent, key.tokens
            self.cached.setdefault(key.hash, block)  # (a twin computed meanwhile stays the one found)
        self.req_num_hashed[req.request_id] = start + len(keys)

    def take_registered(self) -> list[tuple[BlockKey, int]]:
        """The (key, block id) of every block registered since the last call (the engine saves them)."""
        if not self.registered:
            return []
        out, self.registered = self.registered, []
        return out

    # -- allocation -------------------------------------------------------
    def can_allocate(self, req: Request, num_new_tokens: int, computed: list[Block] = ()) -> bool:
        return self._num_new_blocks(req, num_new_tokens, computed) <= self.num_free_blocks - sum(
            1 for b in computed if b.ref_count == 0
        )

    def allocate(self, req: Request, num_new_tokens: int, computed: list[Block] = (), hits: bool = True) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens (after `computed` prefix hits; `hits`:
        count them as prefix hits, which a request waiting for a second tier's blocks does at its admission).

        Returns False, changing nothing, when the free blocks are not enough.
        """
        if not self.can_allocate(req, num_new_tokens, computed):
            return False
        num_new = self._num_new_blocks(req, num_new_tokens, computed)
        blocks = self.req_blocks.setdefault(req.request_id, [])
        for block in computed:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1
            blocks.append(block)
        if computed:
            self.req_num_hashed[req.request_id] = len(computed)
            self.prefix_hits += len(computed) if hits else 0
        for _ in range(num_new):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:  # evict its cached contents
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = block.parent_hash = block.token_ids = None
            block.ref_count = 1
            blocks.append(block)
        req.block_ids = [b.block_id for b in blocks]
        return True

    def _num_new_blocks(self, req: Request, num_new_tokens: int, computed) -> int:
        held = len(self.req_blocks.get(req.request_id, ())) + len(computed)
        total = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        return max(0, self.blocks_needed(total) - held)

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first (see the module docstring)."""
        if req.reuse_shifted:
            self._keep_source(req)
        for block in reversed(self.req_blocks.pop(req.request_id, [])):
            if block.block_id != NULL_BLOCK:
                self._unref(block)
        self.req_num_hashed.pop(req.request_id, None)
        self.req_num_released.pop(req.request_id, None)
        self.req_approx.pop(req.request_id, None)
        req.block_ids = []

    def _unref(self, block: Block) -> None:
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block.block_id] = block
            if block.block_hash is None:  # nothing to hit: handed out again first (the module's docstring)
                self.free_queue.move_to_end(block.block_id, last=False)

    def release_out_of_window(self, req: Request) -> int:
        """Hand back the request's blocks that lie wholly before the sliding window of its next token
        (a query at position p sees keys after p - window); returns how many.

        With prefix caching the last registered block is kept, as the next block's hash chains from it.
        """
        if self.window <= 0:
            return 0
        blocks = self.req_blocks.get(req.request_id)
        if not blocks:
            return 0
        dead = max(0, req.num_computed_tokens - self.window + 1) // self.block_size
        if self.enable_prefix_caching:
            dead = min(dead, self.req_num_hashed.get(req.request_id, 0) - 1)
        start = self.req_num_released.get(req.request_id, 0)
        if dead <= start:
            return 0
        null = self.blocks[NULL_BLOCK]
        for i in range(start, dead):
            self._unref(blocks[i])
            blocks[i] = null
        self.req_num_released[req.request_id] = dead
        self.released_blocks += dead - start
        req.block_ids = [b.block_id for b in blocks]
        return dead - start

    def trim(self, req: Request) -> int:
        """Give back the request's blocks past its computed tokens (a verify's rejected positions held
        them); returns how many. None of them is registered: their tokens were never verified."""
        blocks = self.req_blocks.get(req.request_id)
        if not blocks:
            return 0
        keep = max(self.blocks_needed(req.num_computed_tokens), self.req_num_hashed.get(req.request_id, 0))
        extra = blocks[keep:]
        if not extra:
            return 0
        del blocks[keep:]
        for block in reversed(extra):
            self._unref(block)
        req.block_ids = [b.block_id for b in blocks]
        return len(extra)

    def cache_full_blocks(self, req: Request) -> None:
        """Register the request's newly completed blocks (all tokens computed and known) for prefix hits."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_blocks.get(req.request_id, [])
        num_full = min(min(req.num_computed_tokens, req.num_tokens) // self.block_size, len(blocks))
        start = self.req_num_hashed.get(req.request_id, 0)
        parent = blocks[start - 1].block_hash if start > 0 else req.cache_salt
        approx_from, nonce = self.req_approx.get(req.request_id, (num_full, 0))
        for i in range(start, num_full):
            block = blocks[i]
            tokens = req.key_tokens(i * self.block_size, (i + 1) * self.block_size)
            if i == approx_from:  # shifted contents from here on: a chain no exact lookup computes
                parent = block_hash(parent, (-1, nonce & 0x7FFFFFFF, nonce >> 31))
            h = block_hash(parent, tokens)
            if block.block_hash is None:
                block.block_hash, block.parent_hash, block.token_ids = h, parent, tokens
                exact = i < approx_from
                if self.cached.setdefault(h, block) is block and self.registered is not None and exact:
                    self.registered.append((BlockKey(h, parent, tokens), block.block_id))
            parent = h
        self.req_num_hashed[req.request_id] = max(start, num_full)

    # -- shifted reuse (kv_reuse.py) ------------------------------------------
    def _keep_source(self, req: Request) -> None:
        """Keep the request's registered blocks as a source for the next request of its salt."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_blocks.get(req.request_id, [])
        n = self.req_num_hashed.get(req.request_id, 0)
        if n == 0 or self.req_num_released.get(req.request_id) or any(b.block_hash is None for b in blocks[:n]):
            return
        tokens = list(req.key_tokens(0, n * self.block_size))  # (as its blocks are keyed: images by their key)
        approx = self.req_approx.get(req.request_id)
        source = ReuseSource(
            tokens, [b.block_hash for b in blocks[:n]], approx[0] if approx and approx[0] < n else None
        )
        kept = self.reuse_sources.setdefault(req.cache_salt, deque(maxlen=REUSE_SOURCES))
        for old in list(kept):  # one it extends says nothing more
            if len(old.tokens) <= len(tokens) and tokens[: len(old.tokens)] == old.tokens:
                kept.remove(old)
        kept.append(source)

    def _usable_blocks(self, source: ReuseSource) -> list[Block]:
        """The source's leading blocks still cached with its contents."""
        out = []
        for i, h in enumerate(source.hashes):
            block = self.cached.get(h)
            if block is None or block.token_ids != tuple(
                source.tokens[i * self.block_size : (i + 1) * self.block_size]
            ):
                break
            out.append(block)
        return out

    def plan_reuse(self, req: Request, computed: list[Block], min_run: int, settle: int = 0) -> ReusePlan | None:
        """The best plan over the recent prompts of the request's salt for its positions after its `computed`
        hits (None: nothing to reuse)."""
        if not req.reuse_shifted or not self.enable_prefix_caching or req.computes_every_position:
            return None
        start, limit = len(computed) * self.block_size, req.num_tokens - 1
        tokens = list(req.key_tokens(0, req.num_tokens))
        best = None
        for source in reversed(self.reuse_sources.get(req.cache_salt, ())):
            usable = len(self._usable_blocks(source)) * self.block_size
            runs = plan_runs(source, usable, tokens, start, limit, min_run, settle)
            if runs and (best is None or runs[-1].dst + runs[-1].length > best.end):
                best = ReusePlan(source, runs)
        return best

    def take_reuse(self, req: Request, plan: ReusePlan) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
        """The request was admitted with `plan` (its blocks allocated): cut the plan where a source block is no
        longer cached (its allocation may have evicted one), pin the source blocks, mark the request's chain;
        returns (source slot, slot, shift) per row to copy, and the request's spans those rows fill."""
        blocks = self._usable_blocks(plan.source)
        usable = len(blocks) * self.block_size
        runs = []
        for run in plan.runs:
            n = min(run.length, usable - run.src)
            if n > 0:
                runs.append(Run(run.src, run.dst, n))
            if n < run.length:
                break
        if not runs:
            return [], []
        bs, table = self.block_size, req.block_ids
        rows = [
            (blocks[s // bs].block_id * bs + s % bs, table[d // bs] * bs + d % bs, run.shift)
            for run in runs
            for s, d in zip(range(run.src, run.src + run.length), range(run.dst, run.dst + run.length))
        ]
        for i in sorted({s // bs for r in runs for s in range(r.src, r.src + r.length)}):
            self.pin(blocks[i])
        inexact = ReusePlan(plan.source, runs).first_inexact(bs)
        if inexact is not None:
            self._nonce += 1
            self.req_approx[req.request_id] = (inexact // bs, self._nonce)
        spans: list[tuple[int, int]] = []
        for run in runs:
            if spans and spans[-1][1] == run.dst:
                spans[-1] = (spans[-1][0], run.dst + run.length)
            else:
                spans.append((run.dst, run.dst + run.length))
        return rows, spans

    def pin(self, block: Block) -> None:
        """Hold a block (rows are copied out of it this step) as an owner would."""
        if block.ref_count == 0:
            del self.free_queue[block.block_id]
        block.ref_count += 1
        self.pinned.append(block)

    def unpin_all(self) -> None:
        for block in self.pinned:
            self._unref(block)
        self.pinned.clear()

    # -- checks -----------------------------------------------------------
    def check_integrity(self) -> None:
        """free + used == usable, reference counts match the owners, the null block untouched."""
        refs = [0] * self.num_blocks
        for req_id, blocks in self.req_blocks.items():
            released = self.req_num_released.get(req_id, 0)
            assert all(b.block_id == NULL_BLOCK for b in blocks[:released]), f"{req_id}: a released block still held"
            assert all(b.block_id != NULL_BLOCK for b in blocks[released:]), (
                f"{req_id}: the null block inside the window"
            )
            for b in blocks[released:]:
                refs[b.block_id] += 1
        for b in self.pinned:
            refs[b.block_id] += 1
        null = self.blocks[NULL_BLOCK]
        assert null.ref_count == 0 and NULL_BLOCK not in self.free_queue and refs[NULL_BLOCK] == 0, "null block used"
        for b in self.blocks[1:]:
            assert b.ref_count == refs[b.block_id], (
                f"block {b.block_id}: ref_count {b.ref_count} != {refs[b.block_id]} owners"
            )
            assert (b.ref_count == 0) == (b.block_id in self.free_queue), f"block {b.block_id} free-queue mismatch"
        for h, b in self.cached.items():
            assert b.block_hash == h, f"cached block {b.block_id} hash mismatch"
        assert self.num_free_blocks + sum(1 for b in self.blocks[1:] if b.ref_count > 0) == self.num_usable_blocks

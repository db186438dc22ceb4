"""What the scheduler needs of a second tier of prefix blocks (kv_offload/tier.py's DiskTier is the real one).

The prefix cache keeps full blocks in the KV pool until the pool needs them back. A second tier keeps them
past that, past the model's unload and the daemon's restart: every block the prefix cache registers is
offered to it (`save`, its contents copied at once), and a request whose next blocks the pool no longer
holds asks it how many it has (`match`); when that run pays for the round trip, the scheduler gives the
request fresh blocks, the tier reads into them off the step (`load`), and the request waits outside the
queue while the engine steps the others, until `poll` says its blocks are in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol


class BlockKey(NamedTuple):
    """A full block's identity in the prefix cache's chain: its hash, its parent's (the first block's: the
    request's cache salt) and its tokens. The tier checks all three before a block is served."""

    hash: int
    parent: int
    tokens: tuple[int, ...]


class TierCounters(NamedTuple):
    """What a tier did for one engine, over its life."""

    read_blocks: int = 0  # blocks read back intact
    read_bytes: int = 0
    written_blocks: int = 0
    written_bytes: int = 0
    bad_blocks: int = 0  # torn, corrupt or vanished files found on reading: misses, removed
    write_errors: int = 0  # writes that failed (a full or read-only disk): logged misses
    skipped_blocks: int = 0  # offered while the writer was too far behind: not kept


class BlockTier(Protocol):
    identity: str  # what its blocks are filed under: everything besides the tokens that decides their contents
    min_blocks: int  # a run shorter than this is recomputed: reading it would not be cheaper

    def match(self, keys: Sequence[BlockKey]) -> int:
        """How many of `keys`, from the first, the tier holds."""

    def load(self, request_id: str, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> None:
        """Start reading `keys` into the pool's `block_ids` (the request holds them; nobody reads them)."""

    def poll(self) -> list[tuple[str, int]]:
        """The loads finished since the last call: (request id, how many blocks, from the first, came in
        intact). A block after a torn or missing one is not counted: the request recomputes from there."""

    def save(self, blocks: Sequence[tuple[BlockKey, int]]) -> None:
        """Keep these registered blocks (key, block id); their contents are copied before this returns."""

    def counters(self) -> TierCounters:
        """Its counts for this engine so far."""

    def close(self) -> None:
        """The engine is let go: finish the writes and reads under way."""

"""The prompt cache's folder: one file per KV block, bounded, least recently used out first. Torch-free.

Layout: `<root>/<identity>/<hash>.kv`, where the identity (identity.py) digests everything that decides a
block's contents (the model's files, the weights path, the cache types, the block size, the rotary
settings, the kernels) and the hash is the prefix cache's chained hash (core/block_manager.py), whose root
is the request's cache salt. `<root>/<identity>/model.json` says in words what the identity stands for.

A file: a fixed header (magic, format, token count, identity, hash, parent hash, payload length, the
payload's CRC-32), the block's token ids, the CRC-32 of all of that, then the payload (the block's rows
of every layer's K and V as the pool keeps them). Reading checks the size, both checksums, and that the
identity, hash, parent and tokens are the ones asked for: anything else is a miss, and the file is
removed. Files are written to a temporary name and renamed, 0600 in 0700 folders.

One `PromptDiskCache` per folder per process (`open_cache`): the engines of every loaded model share its
byte budget. Its index is rebuilt at start from the folder (the files' modification times order it, and a
hit touches its file); a file another process removed is a miss.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import struct
import threading
import time
import zlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from minibatch.engine.core.kv_tier import BlockKey

log = logging.getLogger("minibatch.prompt_cache")

MAGIC = b"MBKV"
FORMAT = 1
# magic, format, tokens, identity (16 bytes), hash, parent, payload bytes, payload CRC-32
HEAD = struct.Struct("<4sHH16sQQQI")
SUFFIX = ".kv"
DESCRIPTION = "model.json"
ERROR_LOG_INTERVAL = 60.0  # seconds between two log lines about failing writes
DEFAULT_GB = 8.0  # the daemon's --prompt-cache-gb
# A run of blocks on disk shorter than this many tokens is recomputed, not read: below it the round trip (the
# request waits a step for its blocks) costs more than computing them (BENCHMARKS.md "The disk prompt cache")
DEFAULT_MIN_TOKENS = 32
FOLDER_VARIABLE = "MINIBATCH_PROMPT_CACHE_DIR"
UNBOUNDED = 1 << 62  # the budget of a folder only listed or cleared


def default_folder() -> Path:
    """$MINIBATCH_PROMPT_CACHE_DIR, else prompt-cache/ in the user's cache folder."""
    import platformdirs

    env = os.environ.get(FOLDER_VARIABLE)
    return Path(env) if env else Path(platformdirs.user_cache_dir("minibatch")) / "prompt-cache"


def file_size(num_tokens: int, payload_bytes: int) -> int:
    return HEAD.size + 4 * num_tokens + 4 + payload_bytes


def encode(identity: str, key: BlockKey, payload: bytes | memoryview) -> bytes:
    """A file's bytes before its payload (the payload follows them as it is)."""
    head = HEAD.pack(
        MAGIC,
        FORMAT,
        len(key.tokens),
        bytes.fromhex(identity),
        key.hash,
        key.parent,
        len(payload),
        zlib.crc32(payload),
    )
    head += array("i", key.tokens).tobytes()
    return head + struct.pack("<I", zlib.crc32(head))


def decode(data: bytes, identity: str, key: BlockKey, payload_bytes: int) -> memoryview | None:
    """The payload of a file's bytes when they are whole and are the block asked for, else None."""
    n = len(key.tokens)
    if len(data) != file_size(n, payload_bytes):
        return None
    magic, fmt, tokens, ident, h, parent, length, crc = HEAD.unpack_from(data)
    if (magic, fmt, tokens, ident, h, parent, length) != (
        MAGIC,
        FORMAT,
        n,
        bytes.fromhex(identity),
        key.hash,
        key.parent,
        payload_bytes,
    ):
        return None
    end = HEAD.size + 4 * n
    (head_crc,) = struct.unpack_from("<I", data, end)
    if zlib.crc32(memoryview(data)[:end]) != head_crc or tuple(array("i", data[HEAD.size : end])) != key.tokens:
        return None
    payload = memoryview(data)[end + 4 :]
    return payload if zlib.crc32(payload) == crc else None


@dataclass(slots=True)
class IdentityUsage:
    """One identity's files, as `minibatchd prompt-cache` lists them."""

    identity: str
    blocks: int
    bytes: int
    last_used: float  # wall time of its newest file
    description: dict  # its model.json (empty when missing or unreadable)


class PromptDiskCache:
    def __init__(self, root: Path, budget_bytes: int) -> None:
        self.root = Path(root)
        self.budget = budget_bytes
        self._lock = threading.Lock()
        self._files: OrderedDict[tuple[str, int], int] = OrderedDict()  # (identity, hash) -> bytes; LRU first
        self.bytes = 0
        self.evicted_blocks = 0
        self._described: set[str] = set()
        self._error_logged_at = -ERROR_LOG_INTERVAL
        self._scan()

    # -- the index --------------------------------------------------------
    def _scan(self) -> None:
        """The index from the folder as it is (oldest first); stray temporary files removed; then the budget."""
        found = []
        try:
            idents = [d for d in os.scandir(self.root) if d.is_dir(follow_symlinks=False)]
        except OSError:
            idents = []
        for d in idents:
            try:
                entries = list(os.scandir(d.path))
            except OSError:
                continue
            for e in entries:
                try:
                    if e.name.startswith(".tmp-"):
                        os.unlink(e.path)
                    elif e.name.endswith(SUFFIX):
                        st = e.stat(follow_symlinks=False)
                        found.append((st.st_mtime_ns, d.name, int(e.name[: -len(SUFFIX)], 16), st.st_size))
                except (OSError, ValueError):
                    continue
        found.sort()
        with self._lock:
            for _, ident, h, size in found:
                self._files[(ident, h)] = size
                self.bytes += size
            self._evict_to(self.budget)

    def _evict_to(self, limit: int) -> None:
        """Remove the least recently used files until the folder holds at most `limit` bytes (lock held)."""
        while self.bytes > limit and self._files:
            (ident, h), size = self._files.popitem(last=False)
            self.bytes -= size
            self.evicted_blocks += 1
            try:
                os.unlink(self.path(ident, h))
            except OSError:
                pass

    def path(self, identity: str, h: int) -> Path:
        return self.root / identity / f"{h:016x}{SUFFIX}"

    def has(self, identity: str, h: int) -> bool:
        return (identity, h) in self._files

    def touch(self, identity: str, h: int) -> None:
        """Mark a block used now (a hit, or a block registered again): the last to go."""
        with self._lock:
            if (identity, h) not in self._files:
                return
            self._files.move_to_end((identity, h))
        try:
            os.utime(self.path(identity, h))
        except OSError:
            pass

    def _forget(self, identity: str, h: int, remove: bool) -> None:
        with self._lock:
            size = self._files.pop((identity, h), None)
            if size is not None:
                self.bytes -= size
        if remove:
            try:
                os.unlink(self.path(identity, h))
            except OSError:
                pass

    # -- blocks -----------------------------------------------------------
    def read(self, identity: str, key: BlockKey, payload_bytes: int) -> memoryview | None:
        """The block's payload, or None: not there, or torn, corrupt, of the wrong size or another block's
        (then its file is removed and the reason logged)."""
        if not self.has(identity, key.hash):
            return None
        path = self.path(identity, key.hash)
        try:
            with open(path, "rb") as f:
                data = f.read(file_size(len(key.tokens), payload_bytes) + 1)
        except OSError as exc:
            log.warning("prompt cache: %s unreadable (%s): a miss", path, exc.strerror or exc)
            self._forget(identity, key.hash, remove=False)
            return None
        payload = decode(data, identity, key, payload_bytes)
        if payload is None:
            log.warning("prompt cache: %s is torn, corrupt or another block's (%d bytes): removed", path, len(data))
            self._forget(identity, key.hash, remove=True)
            return None
        self.touch(identity, key.hash)
        return payload

    def write(self, identity: str, key: BlockKey, payload: bytes | memoryview) -> int:
        """Keep a block; returns the bytes written (0 when it was there already or did not fit the budget).
        Raises OSError when the disk refuses (full, read-only): the caller counts a logged miss."""
        if self.has(identity, key.hash):
            return 0
        head = encode(identity, key, payload)
        size = len(head) + len(payload)
        if size > self.budget:
            return 0
        folder = self.root / identity
        tmp = folder / f".tmp-{threading.get_ident():x}-{key.hash:016x}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except FileNotFoundError:  # the folder is gone (cleared, or never made): make it again
            private_dir(folder)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(head)
                f.write(payload)
            with self._lock:  # room first: the folder never holds more than the budget
                self._evict_to(self.budget - size)
                self.bytes += size
            try:
                os.rename(tmp, self.path(identity, key.hash))
            except BaseException:
                with self._lock:
                    self.bytes -= size
                raise
            with self._lock:
                self._files[(identity, key.hash)] = size
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return size

    def failed_write(self, exc: OSError) -> None:
        """Log a refused write (at most once a minute: a full disk refuses every block)."""
        now = time.monotonic()
        if now - self._error_logged_at >= ERROR_LOG_INTERVAL:
            self._error_logged_at = now
            why = "the disk is full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
            log.warning("prompt cache: cannot write under %s (%s): blocks are not kept", self.root, why)

    # -- identities -------------------------------------------------------
    def describe(self, identity: str, facts: dict) -> None:
        """Write what an identity stands for (once per process; 0700 folder, 0600 file)."""
        if identity in self._described:
            return
        folder = self.root / identity
        try:
            private_dir(folder)
            tmp = folder / f".tmp-{threading.get_ident():x}-{DESCRIPTION}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(facts, f, indent=2, sort_keys=True)
            os.rename(tmp, folder / DESCRIPTION)
            self._described.add(identity)
        except OSError as exc:
            self.failed_write(exc)

    def usage(self) -> list[IdentityUsage]:
        """Every identity's files, the most recently used first."""
        with self._lock:
            items = list(self._files.items())
        per: dict[str, list[int]] = {}
        for (ident, _), size in items:
            per.setdefault(ident, [0, 0])
            per[ident][0] += 1
            per[ident][1] += size
        out = []
        for ident, (blocks, size) in per.items():
            out.append(IdentityUsage(ident, blocks, size, _newest(self.root / ident), _description(self.root, ident)))
        return sorted(out, key=lambda u: -u.last_used)

    def clear(self, identity: str | None = None) -> tuple[int, int]:
        """Remove every block (of one identity); returns (blocks, bytes) removed."""
        with self._lock:
            doomed = [(k, size) for k, size in self._files.items() if identity is None or k[0] == identity]
            for k, size in doomed:
                del self._files[k]
                self.bytes -= size
        for (ident, h), _ in doomed:
            try:
                os.unlink(self.path(ident, h))
            except OSError:
                pass
        return len(doomed), sum(size for _, size in doomed)


def private_dir(path: Path) -> None:
    """Make `path` (and its parents) with 0700 folders; an existing one is left as it is."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)


def _newest(folder: Path) -> float:
    try:
        return max((e.stat().st_mtime for e in os.scandir(folder) if e.name.endswith(SUFFIX)), default=0.0)
    except OSError:
        return 0.0


def _description(root: Path, identity: str) -> dict:
    try:
        return json.loads((root / identity / DESCRIPTION).read_text())
    except (OSError, ValueError):
        return {}


def identity_digest(facts: dict) -> str:
    """The 32 hex digits naming an identity's folder: a digest of its facts."""
    return hashlib.blake2b(json.dumps(facts, sort_keys=True).encode(), digest_size=16).hexdigest()


_OPEN: dict[Path, PromptDiskCache] = {}
_OPEN_LOCK = threading.Lock()


def inspect(root: Path) -> PromptDiskCache | None:
    """The folder's files as they are, to list or clear (no budget: nothing is evicted); None when missing."""
    root = Path(root).expanduser()
    if not root.is_dir():
        return None
    with _OPEN_LOCK:
        cache = _OPEN.get(root.resolve())
    return cache if cache is not None else PromptDiskCache(root.resolve(), UNBOUNDED)


def open_cache(root: Path, budget_bytes: int) -> PromptDiskCache:
    """The process's cache of this folder (made 0700 if missing); the budget is the latest asked for."""
    root = Path(root).expanduser().resolve()
    private_dir(root)
    with _OPEN_LOCK:
        cache = _OPEN.get(root)
        if cache is None:
            cache = _OPEN[root] = PromptDiskCache(root, budget_bytes)
        elif cache.budget != budget_bytes:
            cache.budget = budget_bytes
            with cache._lock:
                cache._evict_to(budget_bytes)
        return cache


def summary(cache: PromptDiskCache | None, budget: int, loaded: dict[str, str]) -> dict:
    """The folder as `GET /v1/prompt-cache` and `minibatchd prompt-cache` show it: the bytes against the
    budget, and per identity its model, blocks, bytes, last use and whether it is loaded now (`loaded`:
    identity -> the loaded model's name)."""
    usage = cache.usage() if cache is not None else []
    return {
        "budget_bytes": budget,
        "bytes": sum(u.bytes for u in usage),
        "blocks": sum(u.blocks for u in usage),
        "evicted_blocks": cache.evicted_blocks if cache is not None else 0,
        "models": [
            {
                "identity": u.identity,
                "model": loaded.get(u.identity) or u.description.get("model", "?"),
                "loaded": u.identity in loaded,
                "blocks": u.blocks,
                "bytes": u.bytes,
                "last_used": u.last_used,
                "kv_cache_type": u.description.get("kv_cache_type"),
                "block_size": u.description.get("block_size"),
                "weights": u.description.get("weights"),
            }
            for u in usage
        ],
    }

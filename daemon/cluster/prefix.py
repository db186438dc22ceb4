"""What a request's prompt starts with, as a chain of block hashes the router can match (no tokenizer, no Ray).

The ingress never tokenizes: it hashes the request's prompt text in blocks of
BLOCK_CHARS characters, each hash covering every block before it (as the
engine's own KV block hashes cover every token before them). Two requests
whose texts start alike share their leading hashes, so the router can find the
replica that served the longest common start — a conversation's next turn, or
another request with the same system prompt — with dictionary lookups.
scripts/features/bench_cluster.py measures this against rendering and tokenizing.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict

BLOCK_CHARS = 64  # about one 16-token KV block of English text
MAX_CHARS = 16384  # a prompt's first 16 KiB of text route it; what follows does not
ROUTED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/api/chat", "/api/generate"})


def _content(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in value)
    return "" if value is None else json.dumps(value, sort_keys=True)


def prompt_segments(path: str, body: dict) -> list[str] | None:
    """The texts a request's prompt is made from, in order, or None when the body names none.

    Chat requests: one segment per message (its role and content, tool calls
    included), after the tool definitions; completions: the prompt (the first
    of a batch), after Ollama's `system`."""
    if not isinstance(body, dict):
        return None
    parts: list[str] = []
    if path in ("/v1/chat/completions", "/api/chat"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        if isinstance(body.get("tools"), list):
            parts.append(json.dumps(body["tools"], sort_keys=True))
        for m in messages:
            if not isinstance(m, dict):
                return None
            calls = json.dumps(m["tool_calls"], sort_keys=True) if m.get("tool_calls") else ""
            parts.append(f"<{m.get('role')}>{_content(m.get('content'))}{calls}")
    elif path in ("/v1/completions", "/api/generate"):
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of prompts: the first routes it
        if isinstance(prompt, list):  # token ids
            prompt = " ".join(str(t) for t in prompt)
        if not isinstance(prompt, str) or not prompt:
            return None
        if isinstance(body.get("system"), str):
            parts.append(f"<system>{body['system']}")
        parts.append(prompt)
    else:
        return None
    return parts


def block_hashes(segments: list[str]) -> list[int]:
    """The hash of the text's start at every BLOCK_CHARS characters and at every segment's end.

    Each hash covers all the text before its cut, so a request that starts
    with another's whole text (the next turn of a conversation) has every
    one of the other's hashes among its own: the cuts at message ends line up
    even when a message is shorter than a block."""
    text = "".join(segments)[:MAX_CHARS]
    cuts, at = set(range(BLOCK_CHARS, len(text) + 1, BLOCK_CHARS)), 0
    for seg in segments:
        at += len(seg)
        if at >= len(text):
            break
        cuts.add(at)
    cuts.add(len(text))
    out, h, prev = [], hashlib.blake2b(digest_size=8), 0
    for cut in sorted(cuts):
        if cut == 0:
            continue
        h.update(text[prev:cut].encode("utf-8", "surrogatepass"))
        out.append(int.from_bytes(h.copy().digest(), "little"))
        prev = cut
    return out


def rendezvous(key: int, replicas: list[str]) -> str:
    """The replica a key belongs to by highest-random-weight hashing: when a replica comes or goes, only the
    keys that were (or become) its own move."""
    return max(
        replicas,
        key=lambda r: hashlib.blake2b(f"{key}:{r}".encode(), digest_size=8).digest(),
    )


class PrefixTable:
    """Block hash -> the replica that was last sent a prompt through that block; least recently used out first."""

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity
        self._owner: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def longest_match(self, hashes: list[int], alive: set[str]) -> tuple[str | None, int]:
        """(replica, matched blocks) for the longest start of `hashes` recorded for a live replica."""
        for n in range(len(hashes), 0, -1):
            owner = self._owner.get(hashes[n - 1])
            if owner is not None and owner in alive:
                return owner, n
        return None, 0

    def record(self, hashes: list[int], replica: str) -> None:
        for h in hashes:
            self._owner[h] = replica
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, replica: str) -> None:
        for h in [h for h, r in self._owner.items() if r == replica]:
            del self._owner[h]

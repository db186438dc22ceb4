"""Incremental detokenization: text deltas that never split a multi-byte character.

Decoding a token alone can give a different string than decoding it in
context (leading spaces, byte-level pieces of one character). So each step
decodes a short window of recent tokens twice, with and without the new ones,
and emits the difference, holding it back while it ends in an incomplete
character (U+FFFD). Concatenated deltas equal decode(all output tokens).
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the context window
        self.read_offset = 0  # tokens before this are already emitted as text
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the newly complete text (possibly empty)."""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT) and full.startswith(prefix):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end: emit whatever is left, even an incomplete character."""
        rest = self._decode(self.ids)[len(self.text) :]
        self.text += rest
        return rest

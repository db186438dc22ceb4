"""Grammar-constrained decoding: JSON that parses and follows a schema, by masking the tokens that could not.

llguidance (a Rust library with no other dependencies) compiles a JSON schema into a grammar over the
model's own vocabulary and, before each token, says which tokens may come next; the sampler drops the rest.
Chosen over xgrammar by `scripts/bench_grammar.py` (BENCHMARKS.md, *Structured output*): the same mask cost
at one sequence, 3-10x faster compiles, and no dependency on torch, transformers and triton.

The engine's core sees a `Grammar` only through three methods -- fill_mask, accept, is_done -- so it stays
free of both torch and llguidance.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

import numpy as np

# One layout, json.dumps' own: no free whitespace between tokens. With it allowed, a small model can spend
# its whole budget on newlines and indents that the grammar never ends (seen with the built-in model).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """The schema or grammar cannot be compiled; the message says why."""


# A schema's limits, checked before anything walks it (every walk after this is bounded by them): how deep its
# objects and arrays nest, and how many values it holds in all.
MAX_SCHEMA_DEPTH = 64
MAX_SCHEMA_VALUES = 20_000


def check_schema_size(schema) -> None:
    """Raise GrammarError when `schema` nests deeper than MAX_SCHEMA_DEPTH or holds more than MAX_SCHEMA_VALUES
    values (counted without recursion: a hostile schema cannot exhaust the stack here)."""
    stack, values = [(schema, 1)], 0
    while stack:
        value, depth = stack.pop()
        values += 1
        if values > MAX_SCHEMA_VALUES:
            raise GrammarError(f"holds more than {MAX_SCHEMA_VALUES:,} values; at most {MAX_SCHEMA_VALUES:,}")
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth >= MAX_SCHEMA_DEPTH:
                    raise GrammarError(f"nests deeper than {MAX_SCHEMA_DEPTH} levels of objects and arrays")
                stack.append((child, depth + 1))
            else:
                values += 1


# An integer the schema leaves unbounded gets at most 16 digits (as llama.cpp's JSON grammar allows): a
# small model otherwise repeats digits until max_tokens (seen with the built-in model on {"id": integer}).
INTEGER_LIMIT = 10**16 - 1


def bound_integers(schema):
    """A copy of `schema` in which every integer without a bound of its own is limited to 16 digits."""
    if isinstance(schema, list):
        return [bound_integers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bound_integers(v) if k not in ("enum", "const", "default", "examples") else v for k, v in schema.items()}
    if out.get("type") == "integer":
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -INTEGER_LIMIT
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = INTEGER_LIMIT
    return out


class Grammar:
    """One request's grammar state: advances with each token the request takes."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher) -> None:
        self._matcher = matcher

    def fill_mask(self, words: np.ndarray) -> None:
        """Write the allowed next tokens into `words` (int32, one bit per token, C-contiguous)."""
        self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False when the grammar did not allow it (the state is then an error)."""
        return bool(self._matcher.consume_token(token_id))

    def is_done(self) -> bool:
        """Nothing more can follow (the document is complete, or an end token was taken)."""
        return bool(self._matcher.is_stopped())

    def validate(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar would take from here (its state unchanged)."""
        return int(self._matcher.validate_tokens(tokens)) if tokens else 0

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens (a speculative walk's)."""
        if n:
            self._matcher.rollback(n)

    def copy(self) -> Grammar:
        """Another state of the same compiled grammar, where this one is now (n completions compile once)."""
        return Grammar(self._matcher.deep_copy())

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None


class GrammarCompiler:
    """Compiles response formats for one model; its vocabulary is read once, on first use (~0.4 s)."""

    def __init__(self, tokenizer_json: str | Callable[[], str], vocab_size: int, eos_token_ids: list[int]) -> None:
        # the JSON (or what gives it, so a daemon that never constrains an output never serialises its vocabulary)
        self._tokenizer_json, self._vocab_size, self._eos = tokenizer_json, vocab_size, list(eos_token_ids)
        self._tokenizer = None
        self._lock = threading.Lock()

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                spec = self._tokenizer_json() if callable(self._tokenizer_json) else self._tokenizer_json
                self._tokenizer = llguidance.LLTokenizer(spec, n_vocab=self._vocab_size, eos_token=self._eos)
            return self._tokenizer

    def json_schema(self, schema: dict | bool) -> Grammar:
        """A grammar for JSON documents that follow `schema` (a JSON Schema)."""
        import llguidance

        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"the schema must be a JSON object, got {type(schema).__name__}")
        check_schema_size(schema)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(bound_integers(schema)), defaults=JSON_LAYOUT
            )
        except ValueError as exc:
            raise GrammarError(str(exc)) from exc
        return self._matcher(grammar)

    def check_schema(self, schema) -> None:
        """Raise GrammarError when `schema` is not a JSON Schema the library can use."""
        self.json_schema(schema)

    def tool_call(self, tools: list[dict], name: str | None = None) -> Grammar:
        """Exactly one call in the Hermes layout -- <tool_call>, a newline, {"name": ..., "arguments": {...}}, a
        newline, </tool_call> -- to the function `name`, or to any of `tools` ({"name", "parameters"} each), its
        arguments following that function's parameters schema."""
        import llguidance

        for t in tools:
            check_schema_size(t.get("parameters") or {})
        calls = [
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "arguments"],
                "properties": {
                    "name": {"const": t["name"]},
                    "arguments": bound_integers(t.get("parameters") or {"type": "object"}),
                },
            }
            for t in tools
            if name is None or t["name"] == name
        ]
        if not calls:
            raise GrammarError(f"no function named {name!r} among the tools")
        schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_LAYOUT}
        lark = f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {json.dumps(schema)}\n'
        try:
            return self._matcher(llguidance.LLMatcher.grammar_from_lark(lark))
        except ValueError as exc:
            raise GrammarError(str(exc)) from exc

    def json_object(self) -> Grammar:
        """Any JSON object (OpenAI's `json_object` response format)."""
        return self.json_schema({"type": "object"})

    def _matcher(self, grammar: str) -> Grammar:
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return Grammar(matcher)

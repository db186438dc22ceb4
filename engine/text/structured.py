"""Grammar-constrained decoding: JSON that parses and follows a schema, by masking the tokens that could not.

llguidance (a Rust library with no other dependencies) compiles a JSON schema into a grammar over the
model's own vocabulary and, before each token, says which tokens may come next; the sampler drops the rest.
Chosen over xgrammar by `scripts/kernels/bench_grammar.py` (BENCHMARKS.md, *Structured output*): the same mask cost
at one sequence, 3-10x faster compiles, and no dependency on torch, transformers and triton.

The engine's core sees a `Grammar` only through three methods -- fill_mask, accept, is_done -- so it stays
free of both torch and llguidance.
"""

from __future__ import annotations

import json
import re
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


# A grammar's text: bytes at most, and how deep its parentheses nest (checked before any parser recurses).
MAX_GRAMMAR_BYTES = 65_536
MAX_GRAMMAR_DEPTH = MAX_SCHEMA_DEPTH
_GBNF_RULE = re.compile(r"^\s*[A-Za-z0-9_-]+\s*::=", re.MULTILINE)
_UNICODE_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\(?:u([0-9A-Fa-f]{4})|U([0-9A-Fa-f]{8}))")
_LARK_AT = re.compile(r"(?:at )?(\d+)\((\d+)\):\s*")


def is_gbnf(text: str) -> bool:
    """Whether `text` is written in llama.cpp's GBNF (rules defined with `::=`) rather than Lark (`:`)."""
    return _GBNF_RULE.search(text) is not None


def _where(text: str, pos: int) -> str:
    line = text.count("\n", 0, pos) + 1
    return f"line {line}, column {pos - (text.rfind(chr(10), 0, pos) + 1) + 1}"


def check_grammar_size(text: str) -> None:
    """Raise GrammarError when `text` is longer than MAX_GRAMMAR_BYTES or its parentheses nest deeper than
    MAX_GRAMMAR_DEPTH (counted outside quotes, character classes and comments, without recursion)."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"the grammar is {size:,} bytes; at most {MAX_GRAMMAR_BYTES:,}")
    depth, i, n = 0, 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'[/" and not (c == "/" and text[i - 1 : i] not in ("", " ", "\t", "\n", "|", "(", ":")):
            close = "]" if c == "[" else c
            i += 1
            while i < n and text[i] != close and text[i] != "\n":
                i += 2 if text[i] == "\\" else 1
        elif c in "#" or text.startswith("//", i):
            while i < n and text[i] != "\n":
                i += 1
        elif c == "(":
            depth += 1
            if depth > MAX_GRAMMAR_DEPTH:
                raise GrammarError(f"{_where(text, i)}: parentheses nest deeper than {MAX_GRAMMAR_DEPTH} levels")
        elif c == ")":
            depth = max(0, depth - 1)
        i += 1


def gbnf_to_lark(text: str) -> str:
    """llama.cpp's GBNF rewritten in Lark (llguidance's converter); its errors name line and column."""
    from llguidance.gbnf_to_lark import GbnfToLarkError
    from llguidance.gbnf_to_lark import gbnf_to_lark as convert

    try:
        return convert(_UNICODE_ESCAPE.sub(_unescape, text))
    except GbnfToLarkError as exc:
        message = str(exc).rsplit(" at line ", 1)[0]
        raise GrammarError(f"{_where(text, exc.pos.pos)}: {message}") from None
    except RecursionError:
        raise GrammarError("the grammar nests too deeply") from None
    except Exception as exc:  # the converter's own checks (an undefined rule, no root) raise plain Exceptions
        missing = re.fullmatch(r"Rule '(.+)' not found", str(exc))
        if missing:
            use = re.search(rf"(?<![\w-]){re.escape(missing.group(1))}(?![\w-])(?!\s*::=)", text)
            if use:
                raise GrammarError(f"{_where(text, use.start())}: no rule named {missing.group(1)!r}") from None
        if str(exc) == "No 'root' rule found":
            raise GrammarError("no rule named 'root' (a GBNF grammar starts at root)") from None
        raise GrammarError(str(exc)) from None


def _unescape(m: re.Match) -> str:
    """GBNF's \\uXXXX and \\UXXXXXXXX as the character itself (the converter drops their leading zeros, which
    Lark then misreads, and Lark has no \\U), or as \\xHH where the character means something in a grammar."""
    code = int(m.group(2) or m.group(3), 16)
    if 0xD800 <= code <= 0xDFFF or code > 0x10FFFF:
        raise GrammarError(f"\\u{code:04x} is not a character")
    c = chr(code)
    return m.group(1) + (f"\\x{code:02x}" if code < 0x20 or c in '"\\[]^-/' else c)


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

    def text_grammar(self, text: str) -> Grammar:
        """A grammar written by the client: llama.cpp's GBNF (its start rule `root`) or Lark as llguidance
        reads it (its start rule `start`), told apart by how rules are defined (`::=` is GBNF)."""
        import llguidance

        if not isinstance(text, str) or not text.strip():
            raise GrammarError("the grammar is empty")
        check_grammar_size(text)
        gbnf = is_gbnf(text)
        lark = gbnf_to_lark(text) if gbnf else text
        try:
            return self._matcher(llguidance.LLMatcher.grammar_from_lark(lark))
        except GrammarError as exc:
            raise GrammarError(_lark_error(str(exc), gbnf)) from None

    def json_object(self) -> Grammar:
        """Any JSON object (OpenAI's `json_object` response format)."""
        return self.json_schema({"type": "object"})

    def _matcher(self, grammar: str) -> Grammar:
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return Grammar(matcher)


def _lark_error(message: str, converted: bool) -> str:
    """llguidance's message on a Lark grammar, its position first as "line L, column C" (on a converted GBNF
    grammar the position is the Lark text's, so only the reason is kept) and its source excerpt dropped."""
    reason = message.split("\n", 1)[0].strip()
    at = _LARK_AT.match(reason)
    if at is None:
        return reason
    rest = reason[at.end() :]
    return rest if converted else f"line {at.group(1)}, column {at.group(2)}: {rest}"

"""Grammars as clients write them (llama.cpp's GBNF, Lark): every output parses with its grammar, and a broken
grammar is refused with its line and column.

Each grammar below is written in the style of llama.cpp's examples (grammars/*.gbnf) and checked against a
recogniser written here independently of it (a regular expression or JSON), so a wrong conversion would show.
Every repetition is bounded: a tiny random model takes any loop a grammar leaves open.
"""

from __future__ import annotations

import json
import re

import pytest

from minibatch.engine.core.sampling_params import SamplingParams
from minibatch.engine.factory import EngineConfig, build_engine
from minibatch.engine.text.structured import (
    MAX_GRAMMAR_BYTES,
    MAX_GRAMMAR_DEPTH,
    GrammarCompiler,
    GrammarError,
    is_gbnf,
)

ANSWER = ('root ::= ("yes" | "no" | "maybe") "."\n', re.compile(r"(yes|no|maybe)\."))
LIST = (
    'root ::= item{1,4}\nitem ::= "- " word ( " " word )? "\\n"\nword ::= [a-z]{1,8}\n',
    re.compile(r"(- [a-z]{1,8}( [a-z]{1,8})?\n){1,4}"),
)
ARITHMETIC = (
    """# a sum of up to four terms, a term a number or a parenthesised product
root  ::= expr "="
expr  ::= term ( ("+" | "-") term ){0,3}
term  ::= num | "(" inner ")"
inner ::= num ( ("*" | "/") num ){0,2}
num   ::= [1-9] [0-9]{0,2}
""",
    re.compile(r"(N|\(N([*/]N){0,2}\))([+-](N|\(N([*/]N){0,2}\))){0,3}=".replace("N", "[1-9][0-9]{0,2}")),
)
DATETIME = (
    """root  ::= date "T" time
date  ::= [0-9]{4} "-" month "-" day
month ::= "0" [1-9] | "1" [0-2]
day   ::= "0" [1-9] | [12] [0-9] | "3" [01]
time  ::= ( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9]
""",
    re.compile(r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3]):[0-5][0-9]"),
)
PERSON = (
    'root ::= "{" ws "\\"name\\": \\"" [A-Za-z ]{1,10} "\\", \\"age\\": " [0-9]{1,3} ws "}"\nws ::= " "?\n',
    None,  # checked as JSON below
)
UNICODE = ('root ::= "\\u00e9t\\u00e9" | "caf\\u00e9" | "\\U0001F600"\n', re.compile("été|café|\U0001f600"))
LARK = ('start: ("yes" | "no") "!"\n', re.compile(r"(yes|no)!"))
GRAMMARS = {
    "answer": ANSWER,
    "list": LIST,
    "arithmetic": ARITHMETIC,
    "datetime": DATETIME,
    "person": PERSON,
    "unicode": UNICODE,
    "lark": LARK,
}


@pytest.fixture(scope="module")
def compiler(tiny_chat_model_dir):
    from minibatch.engine.text.tokenizer import TextTokenizer

    return GrammarCompiler(TextTokenizer(tiny_chat_model_dir).tokenizer_json(), 49152, [2])


def follows(name: str, text: str) -> bool:
    if name == "person":
        doc = json.loads(text)
        return list(doc) == ["name", "age"] and re.fullmatch("[A-Za-z ]{1,10}", doc["name"]) and 0 <= doc["age"]
    return GRAMMARS[name][1].fullmatch(text) is not None


def test_gbnf_and_lark_are_told_apart():
    assert all(is_gbnf(g) for name, (g, _) in GRAMMARS.items() if name != "lark")
    assert not is_gbnf(LARK[0])
    assert not is_gbnf('start: "a ::= b"\n')  # ::= inside a string of a Lark rule


@pytest.mark.parametrize("mode", ["continuous", "static"])
def test_every_output_parses_with_its_grammar(tiny_chat_model_dir, compiler, mode):
    """Each grammar greedy and sampled (three seeds), all in one batch beside a free request: every output is
    ended by its grammar and recognised; the free request is untouched."""
    e = build_engine(
        EngineConfig(model=str(tiny_chat_model_dir), dtype="float32", mode=mode, max_num_seqs=16, max_wait_ms=0)
    )
    prompt = list(range(200, 230))
    reqs = {}
    for name, (grammar, _) in GRAMMARS.items():
        for seed in (None, 1, 2, 3):
            params = SamplingParams(
                temperature=0 if seed is None else 1.0,
                seed=seed,
                max_tokens=120,
                grammar=compiler.text_grammar(grammar),
            )
            rid = f"{name}-{seed}"
            reqs[rid] = (name, e.add_request(rid, [*prompt, len(reqs)], params))
    free = e.add_request("free", prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    finished = {}
    while e.has_work():
        outputs, _ = e.step()
        finished.update({o.request_id: o for o in outputs if o.finished})
    assert e.scheduler.blocks.num_used_blocks == 0
    texts = {}
    for rid, (name, req) in reqs.items():
        text = e.tokenizer.decode(req.output_token_ids)
        assert finished[rid].finish_reason == "stop", (rid, text)
        assert follows(name, text), (rid, text)
        texts.setdefault(name, set()).add(text)
    assert len(free.output_token_ids) == 24
    # the grammars leave real choices: sampling took more than one of them somewhere
    assert any(len(v) > 1 for v in texts.values()), texts


@pytest.mark.parametrize(
    "grammar,message",
    [
        ('root ::= ( "a" ', "line 1, column 16: Expected ')'"),
        ('root ::= (\n  "a" | "b" foo\n)\n', "line 2, column 13: no rule named 'foo'"),
        ('root ::= "a" [b-\n', "line 2, column 1: Unexpected end of input"),
        ('root ::= "a" ::= "b"', "line 1, column 14: Expected name"),
        ('answer ::= "a"', "no rule named 'root'"),
        ('root ::= "\\ud800"', "\\ud800 is not a character"),
        ('start: "a" foo\n', "line 1, column 8: unknown name"),  # Lark: llguidance's own position
        ("   \n", "the grammar is empty"),
    ],
)
def test_a_broken_grammar_names_line_and_column(compiler, grammar, message):
    with pytest.raises(GrammarError) as err:
        compiler.text_grammar(grammar)
    assert message in str(err.value)


def test_grammars_past_the_limits_are_refused_before_any_parser_recurses(compiler):
    compiler.text_grammar("root ::= " + "(" * MAX_GRAMMAR_DEPTH + '"a"' + ")" * MAX_GRAMMAR_DEPTH)
    for levels in (MAX_GRAMMAR_DEPTH + 1, 5000):  # 5,000 would exhaust the converter's stack
        with pytest.raises(GrammarError, match=f"nest deeper than {MAX_GRAMMAR_DEPTH} levels"):
            compiler.text_grammar("root ::= " + "(" * levels + '"a"' + ")" * levels)
    # parentheses inside strings and classes are text, not nesting
    compiler.text_grammar('root ::= "' + "(" * 200 + '" [(]')
    with pytest.raises(GrammarError, match=f"at most {MAX_GRAMMAR_BYTES:,}"):
        compiler.text_grammar('root ::= "' + "a" * MAX_GRAMMAR_BYTES + '"')

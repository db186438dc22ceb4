"""Structured output in the engine: the mask makes any model's output follow the schema, only where asked.

A tiny random model would write anything; under a grammar every finished output must still parse and
validate, in both modes, across preemptions, beside unconstrained requests that must not change. (Its
schemas bound every number and string: a random model takes any loop a grammar leaves open.)
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch

from minibatch.engine.core.request import Request
from minibatch.engine.core.sampling_params import SamplingParams
from minibatch.engine.factory import EngineConfig, build_engine
from minibatch.engine.runner.sampler import Sampler
from minibatch.engine.text.structured import GrammarCompiler, GrammarError

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "maxLength": 20},
        },
        "required": ["name", "age", "email"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": -100, "maximum": 100}, "minItems": 2, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 9999},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
                },
                "required": ["id", "tags"],
                "additionalProperties": False,
            },
            "ok": {"type": "boolean"},
        },
        "required": ["user", "ok"],
        "additionalProperties": False,
    },
]


@pytest.fixture(scope="module")
def compiler(tiny_chat_model_dir):
    from minibatch.engine.text.tokenizer import TextTokenizer

    tok = TextTokenizer(tiny_chat_model_dir)
    return GrammarCompiler(tok.tokenizer_json(), 49152, [2])


class _AllowOnly:
    """A stand-in grammar that allows one token."""

    def __init__(self, token: int) -> None:
        self.token = token

    def fill_mask(self, words: np.ndarray) -> None:
        words[:] = 0
        words[self.token // 32] = np.int32(np.uint32(1 << (self.token % 32)).view(np.int32))


def test_sampler_masks_only_the_rows_with_a_grammar():
    torch.manual_seed(0)
    logits = torch.randn(3, 1000)
    free = Request("free", [1], SamplingParams(temperature=0))
    forced = Request("forced", [1], SamplingParams(temperature=0, grammar=_AllowOnly(999)))
    sampled = Request("sampled", [1], SamplingParams(temperature=1.0, seed=3, grammar=_AllowOnly(37)))
    want_free = int(logits[0].argmax())
    assert Sampler()(logits.clone(), [free, forced, sampled]) == [want_free, 999, 37]


def test_schemas_that_cannot_be_compiled_say_why(compiler):
    with pytest.raises(GrammarError, match="objectx"):
        compiler.json_schema({"type": "objectx"})
    with pytest.raises(GrammarError, match="must be a JSON object"):
        compiler.json_schema([1, 2])


def test_schemas_past_the_limits_are_refused_without_recursion(compiler):
    from minibatch.engine.text.structured import MAX_SCHEMA_DEPTH, MAX_SCHEMA_VALUES

    def nested(levels: int) -> dict:  # two levels of objects per step: {"properties": {"a": ...}}
        schema: dict = {"type": "integer"}
        for _ in range(levels):
            schema = {"type": "object", "properties": {"a": schema}}
        return schema

    compiler.json_schema(nested(MAX_SCHEMA_DEPTH // 2 - 1))  # within the limit: compiles
    for levels in (MAX_SCHEMA_DEPTH, 5000):  # 5,000 would exhaust the stack of a recursive walk
        with pytest.raises(GrammarError, match=f"nests deeper than {MAX_SCHEMA_DEPTH} levels"):
            compiler.json_schema(nested(levels))
        with pytest.raises(GrammarError, match=f"nests deeper than {MAX_SCHEMA_DEPTH} levels"):
            compiler.tool_call([{"name": "f", "parameters": nested(levels)}])
    wide = {"anyOf": [{"const": i} for i in range(MAX_SCHEMA_VALUES)]}
    with pytest.raises(GrammarError, match="more than 20,000 values"):
        compiler.json_schema(wide)


def test_a_copied_grammar_walks_on_its_own(compiler):
    """n completions compile their schema once and each walks a copy: advancing one leaves the other as it was."""
    first = compiler.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]})
    second = first.copy()
    a, b = np.zeros(49152 // 32, dtype=np.int32), np.zeros(49152 // 32, dtype=np.int32)
    first.fill_mask(a)
    allowed = [t for t in range(49152) if (int(a[t // 32]) >> (t % 32)) & 1]
    assert allowed and first.accept(allowed[0])
    first.fill_mask(a)
    second.fill_mask(b)
    assert not np.array_equal(a, b)  # the copy is still at the start
    assert second.accept(allowed[0])
    second.fill_mask(b)
    assert np.array_equal(a, b)


@pytest.mark.parametrize(
    "mode,num_blocks",
    [("continuous", 400), ("continuous", 16), ("static", 400)],
    ids=["continuous", "continuous-preempting", "static"],
)
def test_every_output_follows_its_schema_and_free_rows_are_untouched(tiny_chat_model_dir, compiler, mode, num_blocks):
    def engine():
        return build_engine(
            EngineConfig(
                model=str(tiny_chat_model_dir),
                dtype="float32",
                mode=mode,
                max_num_seqs=8,
                num_kv_blocks=num_blocks,
                max_wait_ms=0,
            )
        )

    prompt = list(range(100, 140))
    alone = engine()
    reference = alone.add_request("free", prompt, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    while alone.has_work():
        alone.step()

    e = engine()
    reqs = {}
    for i, schema in enumerate(SCHEMAS * 2):  # greedy and sampled, each schema twice
        params = SamplingParams(
            temperature=0 if i < len(SCHEMAS) else 0.9, seed=i, max_tokens=200, grammar=compiler.json_schema(schema)
        )
        reqs[f"s{i}"] = (e.add_request(f"s{i}", [*prompt[: 10 + i], 7 + i], params), schema)
    free = e.add_request("free", prompt, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    finished = {}
    while e.has_work():
        outputs, _ = e.step()
        e.scheduler.blocks.check_integrity()
        finished.update({o.request_id: o for o in outputs if o.finished})
    assert e.scheduler.blocks.num_used_blocks == 0
    if num_blocks == 16:
        assert e.scheduler.num_preemptions > 0  # grammar state survived recompute
    tok = e.tokenizer
    for rid, (req, schema) in reqs.items():
        assert finished[rid].finish_reason == "stop", (
            rid,
            tok.decode(req.output_token_ids)[:300],
        )  # ended by the grammar
        text = tok.decode(req.output_token_ids)
        jsonschema.validate(json.loads(text), schema)
    assert free.output_token_ids == reference.output_token_ids and len(free.output_token_ids) == 48


def test_unbounded_integers_get_sixteen_digits_and_bounded_ones_keep_theirs():
    from minibatch.engine.text.structured import INTEGER_LIMIT, bound_integers

    schema = {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "n": {"type": "integer", "minimum": 3},
            "xs": {"type": "array", "items": {"type": "integer", "exclusiveMaximum": 9}},
            "e": {"enum": [{"type": "integer"}]},
        },
    }
    out = bound_integers(schema)
    props = out["properties"]
    assert props["id"] == {"type": "integer", "minimum": -INTEGER_LIMIT, "maximum": INTEGER_LIMIT}
    assert props["n"] == {"type": "integer", "minimum": 3, "maximum": INTEGER_LIMIT}
    assert props["xs"]["items"] == {"type": "integer", "exclusiveMaximum": 9, "minimum": -INTEGER_LIMIT}
    assert props["e"] == {"enum": [{"type": "integer"}]}  # values are data, not schemas
    assert schema["properties"]["id"] == {"type": "integer"}  # the caller's schema is left as it was

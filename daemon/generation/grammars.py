"""Which grammar constrains a request -- its response format's, the one it wrote, or a required tool call's --
compiled off the event loop's thread (engine/text/structured.py does the compiling). Every schema or grammar
that cannot be used is a 400 naming its field."""

from __future__ import annotations

import asyncio

from ..protocol import ApiError


def _compiler(model, param: str):
    if model.grammars is None:
        raise ApiError(
            400,
            f"{param}: this model's tokenizer cannot drive constrained decoding (it is not a tokenizer.json tokenizer)",
            param,
            "unsupported",
        )
    return model.grammars


async def _compile(param: str, what: str, fn, *args, code: str = "invalid_schema"):
    from minibatch.engine.text.structured import GrammarError

    try:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
    except GrammarError as exc:
        raise ApiError(400, f"{param}: {what}: {exc}", param, code) from None


async def response_grammar(model, fmt: str | dict, param: str):
    """The grammar for a response format: "json" (any JSON object) or a JSON schema; `param` names the field
    in errors."""
    schema = {"type": "object"} if fmt == "json" else fmt
    return await _compile(param, "the schema cannot be used", _compiler(model, param).json_schema, schema)


async def text_grammar(model, text: str, param: str):
    """The grammar the client wrote (llama.cpp's GBNF, or Lark); a broken one is a 400 naming its line and
    column."""
    return await _compile(
        param, "the grammar cannot be used", _compiler(model, param).text_grammar, text, code="invalid_grammar"
    )


async def check_tool_schemas(model, specs: list[dict]) -> None:
    """Every tool's parameters must be a usable JSON Schema, whether or not a call is forced."""
    for i, spec in enumerate(specs):
        parameters = spec["function"].get("parameters")
        if parameters is not None:
            param = f"tools.{i}.function.parameters"
            await _compile(param, "not a usable JSON Schema", _compiler(model, "tools").check_schema, parameters)


async def tool_call_grammar(model, functions: list[dict], name: str | None):
    """The grammar that makes the output exactly one valid call (to `name`, or to any of `functions`)."""
    return await _compile(
        "tools", "the call cannot be constrained", _compiler(model, "tools").tool_call, functions, name
    )

"""Which grammar constrains a request -- its response format's, or a required tool call's -- compiled off the
event loop's thread (engine/text/structured.py does the compiling). Every schema that cannot be used is a 400
naming its field."""

from __future__ import annotations

import asyncio

from .protocol import ApiError


def _compiler(model, param: str):
    if model.grammars is None:
        raise ApiError(
            400,
            f"{param}: this model's tokenizer cannot drive constrained decoding (it is not a tokenizer.json tokenizer)",
            param,
            "unsupported",
        )
    return model.grammars


async def _compile(param: str, what: str, fn, *args):
    from minibatch.engine.text.structured import GrammarError

    try:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
    except GrammarError as exc:
        raise ApiError(400, f"{param}: {what}: {exc}", param, "invalid_schema") from None


async def response_grammar(model, fmt, param: str):
    """The grammar for a response format (None for plain text).

    `fmt` is "json", a JSON schema (dict), or a protocol.ResponseFormat; `param` names the field in errors.
    """
    if fmt is None or getattr(fmt, "type", None) == "text":
        return None
    compiler = _compiler(model, param)
    if getattr(fmt, "type", None) == "json_schema":
        if fmt.json_schema is None:
            raise ApiError(
                400, f"{param}.json_schema: required when type is json_schema", f"{param}.json_schema", "missing"
            )
        if fmt.json_schema.schema_ is None:
            raise ApiError(
                400,
                f"{param}.json_schema.schema: required when type is json_schema",
                f"{param}.json_schema.schema",
                "missing",
            )
        schema, param = fmt.json_schema.schema_, f"{param}.json_schema.schema"
    elif getattr(fmt, "type", None) == "json_object" or fmt == "json":
        schema = {"type": "object"}
    else:
        schema = fmt
    return await _compile(param, "the schema cannot be used", compiler.json_schema, schema)


async def check_tool_schemas(model, specs: list[dict]) -> None:
    """Every tool's parameters must be a usable JSON Schema, whether or not a call is forced."""
    for i, spec in enumerate(specs):
        parameters = spec["function"].get("parameters")
        if parameters is not None:
            param = f"tools.{i}.function.parameters"
            await _compile(param, "not a usable JSON Schema", _compiler(model, "tools").check_schema, parameters)


def forced_call(body, specs: list[dict]) -> tuple[list[dict], str | None] | None:
    """(the functions, the one named or None for any) when tool_choice requires a call, else None."""
    choice = body.tool_choice
    if choice in (None, "auto", "none"):
        return None
    functions = [s["function"] for s in specs]
    name = None
    if choice != "required":
        name = choice.function.name
        if name not in {f["name"] for f in functions}:
            raise ApiError(
                400,
                f"tool_choice.function.name: no tool named {name!r} in tools",
                "tool_choice.function.name",
                "invalid_value",
            )
    if body.response_format is not None and body.response_format.type != "text":
        raise ApiError(
            400, "response_format: cannot be combined with a required tool call", "response_format", "invalid_value"
        )
    return functions, name


async def tool_call_grammar(model, functions: list[dict], name: str | None):
    """The grammar that makes the output exactly one valid call (to `name`, or to any of `functions`)."""
    return await _compile(
        "tools", "the call cannot be constrained", _compiler(model, "tools").tool_call, functions, name
    )

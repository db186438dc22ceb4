"""Counting and reading tokens: `POST /tokenize` and `POST /detokenize`, as llama-server and vLLM shape them.

`/tokenize` takes `content` (a text; `add_special` puts the tokenizer's own special tokens around it, as a raw
prompt gets them) or `messages` (a conversation, with `tools`, rendered by the model's chat template exactly as
a chat request's prompt is: what a conversation will cost before it is sent); `with_pieces` gives each id its
text. It answers the ids, their count and the model's context. `/detokenize` takes `tokens` and answers their
text. `model` names any model the daemon serves (left out: its own).
"""

from __future__ import annotations

from typing import Annotated

from aiohttp import web
from pydantic import ConfigDict, Field, StrictBool, StrictStr

from ..generation import prompt
from ..generation.spec import Generation
from ..protocol import ApiError, Int
from ..state import STATE, off_loop, read_body
from .messages import MAX_TOOLS, Body, Message, Tool

MAX_DETOKENIZE = 1_000_000  # token ids in one /detokenize request at most


class TokenizeRequest(Body):
    # content or messages, one of them; tools only beside messages
    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"required": ["content"], "properties": {"content": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ],
            "dependentRequired": {"tools": ["messages"]},
        }
    )
    model: StrictStr | None = None
    content: StrictStr | None = None  # a text, or
    messages: list[Message] | None = Field(default=None, min_length=1, max_length=1000)  # a conversation
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)  # with messages: as the template shows them
    add_special: StrictBool = False  # content: the tokenizer's special tokens around it (a raw prompt's BOS)
    with_pieces: StrictBool = False  # each id with its text: [{"id", "piece"}]


class DetokenizeRequest(Body):
    model: StrictStr | None = None
    tokens: list[Annotated[Int, Field(ge=0)]] = Field(max_length=MAX_DETOKENIZE)


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request, state, TokenizeRequest)
    if (body.content is None) == (body.messages is None):
        raise ApiError(400, "content: give content (a text) or messages (a conversation), one of them", "content")
    if body.tools is not None and body.messages is None:
        raise ApiError(400, "tools: only with messages (the chat template shows them)", "tools")
    async with state.lease(body.model) as model:
        tok = model.tokenizer
        if body.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            gen = Generation(
                "",
                body.model,
                "messages",
                messages=[m.for_template(f"messages.{i}") for i, m in enumerate(body.messages)],
                tools=tools,
            )
            ids = (await prompt.render(state, model, gen)).prompts[0]
        else:
            ids = await off_loop(tok.encode_prompt if body.add_special else tok.encode, body.content)
        tokens: list = ids
        if body.with_pieces:
            tokens = [{"id": i, "piece": tok.decode([i], skip_special_tokens=False)} for i in ids]
        return web.json_response(
            {"model": model.name, "tokens": tokens, "count": len(ids), "max_model_len": model.info.max_model_len}
        )


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request, state, DetokenizeRequest)
    async with state.lease(body.model) as model:
        vocab = model.info.vocab_size
        bad = next((i for i, t in enumerate(body.tokens) if t >= vocab), None)
        if bad is not None:
            where = f"tokens.{bad}"
            raise ApiError(400, f"{where}: token id {body.tokens[bad]} is out of range [0, {vocab})", where)
        text = await off_loop(model.tokenizer.decode, body.tokens, skip_special_tokens=False)
        return web.json_response({"model": model.name, "content": text})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)

"""What the daemon's API modules share: the daemon's state, the model check, body reading and submission.

The OpenAI-compatible and native routes (app.py) and Ollama's (ollama.py) both build on this module;
neither imports the other's handlers.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from aiohttp import web

from minibatch.engine.core.admission import QueueFull, RequestRejected
from minibatch.engine.core.info import EngineInfo

from .guard import Guard
from .protocol import ApiError, ChatRequest, parse_body

DEFAULT_MAX_TOKENS = 1024


@dataclass
class DaemonState:
    model_name: str
    request_timeout: float = 600.0  # wall-clock limit per request, seconds
    body_timeout: float = 30.0  # seconds to receive a request body
    engine: object | None = None  # AsyncEngine once loaded
    monitor: object | None = None
    tokenizer: object | None = None
    grammars: object | None = None  # engine.structured.GrammarCompiler, when the tokenizer allows one
    info: EngineInfo | None = None  # the engine's facts, once loaded
    started_at: float = field(default_factory=time.time)
    status: str = "loading"  # loading | ready | draining | failed
    load_error: str | None = None

    def ready_engine(self):
        if self.status == "draining":
            raise ApiError(503, "the daemon is shutting down", None, "shutting_down", "unavailable")
        if self.status != "ready" or self.engine is None:
            msg = (
                "the model is still loading"
                if self.status == "loading"
                else f"the engine is not available: {self.load_error}"
            )
            raise ApiError(503, msg, None, "not_ready", "unavailable", {"Retry-After": "2"})
        if not self.engine.alive:
            why = self.engine.fatal_error or "the engine thread has stopped"
            raise ApiError(503, f"{why}; see the log", None, "engine_dead", "unavailable")
        return self.engine


STATE = web.AppKey("state", DaemonState)
GUARD = web.AppKey("guard", Guard)


async def read_raw(request: web.Request, state: DaemonState) -> bytes:
    """The request body, or 408 when the client takes longer than the body timeout to send it."""
    try:
        return await asyncio.wait_for(request.read(), state.body_timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"request body not received within {state.body_timeout:g} s", None, "timeout") from None


async def read_body(request: web.Request, state: DaemonState, model):
    return parse_body(await read_raw(request, state), model)


def model_names(served: str) -> tuple[str, ...]:
    """The names a request may give the served model: its own, with Ollama's tag (clients that list models
    over /api/tags send it back, as oterm does), or "default"."""
    return served, f"{served}:latest", "default"


def check_model(state: DaemonState, name: str | None) -> None:
    if name is not None and name not in model_names(state.model_name):
        raise ApiError(
            404, f"model {name!r} does not exist; this daemon serves {state.model_name!r}", "model", "model_not_found"
        )


def submit(
    state: DaemonState,
    engine,
    body,
    ids: list[int],
    request_id: str,
    grammar=None,
    index: int = 0,
    share_prompt_with: str | None = None,
    prompt_index: int | None = None,
) -> None:
    """Submit one completion; a refusal becomes the API's error, naming the field and, in a batch of
    prompts (`prompt_index`), the prompt: `prompt.1`, `prompt.0.3` (its token 3)."""
    limit = state.info.max_model_len
    # Unset max_tokens: what fits the context (at least 1, so a prompt that fills it is refused as too long).
    default_max = max(1, min(DEFAULT_MAX_TOKENS, limit - len(ids))) if limit else DEFAULT_MAX_TOKENS
    params = body.sampling_params(default_max, state.info.generation_defaults)
    params.grammar = grammar
    if index and params.seed is not None:  # the n completions of one request draw differently, reproducibly
        params.seed = (params.seed + index) % 2**63
    try:
        engine.submit(ids, params, request_id, share_prompt_with)
    except QueueFull as exc:
        raise ApiError(exc.status, str(exc), exc.field, exc.code, "rate_limit_error", {"Retry-After": "1"}) from None
    except RequestRejected as exc:
        param, message = exc.field, str(exc)
        if isinstance(body, ChatRequest) and param == "prompt":
            param = "messages"  # what the chat API turns into the prompt
        elif param is not None and param.split(".")[0] == "prompt":
            if prompt_index is not None:
                param = f"prompt.{prompt_index}{param[len('prompt') :]}"
            message = f"{param}: {message}" if "." in param else message
        elif prompt_index is not None:
            message = f"prompt.{prompt_index}: {message}"
        raise ApiError(exc.status, message, param, exc.code) from None

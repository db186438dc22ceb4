"""What the daemon's API modules share: the daemon's state, the model check, body reading and submission.

The OpenAI-compatible and native routes (app.py) and Ollama's (ollama.py) both build on this module;
neither imports the other's handlers.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field

from aiohttp import web

from minibatch.engine.core.admission import QueueFull, RequestRejected
from minibatch.engine.core.sampling_params import DEFAULT_MAX_TOKENS

from .guard import Guard
from .models.pool import LoadedModel, ModelPool, parse_keep_alive
from .protocol import ApiError, ChatRequest, parse_body


@dataclass
class DaemonState:
    model_name: str  # the daemon's own model (--model): what a request without a model gets
    request_timeout: float = 600.0  # wall-clock limit per request, seconds
    body_timeout: float = 30.0  # seconds to receive a request body
    reasoning_format: str = "auto"  # --reasoning-format: a thinking model's reasoning apart (auto) or not (none)
    pool: ModelPool | None = None  # the loaded models
    started_at: float = field(default_factory=time.time)
    status: str = "loading"  # loading | ready | draining | failed
    load_error: str | None = None

    def check_serving(self) -> ModelPool:
        if self.status == "draining":
            raise ApiError(503, "the daemon is shutting down", None, "shutting_down", "unavailable")
        if self.pool is None or self.status == "failed":
            raise ApiError(503, f"the daemon cannot serve: {self.load_error}", None, "not_ready", "unavailable")
        return self.pool

    def lease(self, name: str | None, keep_alive=None):
        """The model a request names, loaded if need be and held until the request ends (`async with`);
        `keep_alive`: the request's, as parse_keep_alive reads it, or None for the model's own."""
        pool = self.check_serving()
        return pool.lease(name) if keep_alive is None else pool.lease(name, parse_keep_alive(keep_alive))

    def served(self, name: str | None) -> LoadedModel:
        """A loaded model for the engine endpoints (?model=; without it, the daemon's own)."""
        return self.check_serving().served(name)


STATE = web.AppKey("state", DaemonState)
GUARD = web.AppKey("guard", Guard)


async def read_raw(request: web.Request, state: DaemonState) -> bytes:
    """The request body, or 408 when the client takes longer than the body timeout to send it."""
    try:
        return await asyncio.wait_for(request.read(), state.body_timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"request body not received within {state.body_timeout:g} s", None, "timeout") from None


def timed_out(state: DaemonState) -> ApiError:
    """The one error every API face answers when a request runs past --request-timeout (each face puts it in
    its own shape; a stream already under way sends it as its last event)."""
    return ApiError(
        504, f"the request ran past its limit of {state.request_timeout:g} s and was aborted", None, "timeout"
    )


async def off_loop(fn, *args, **kwargs):
    """fn(*args, **kwargs) on the default executor's threads: parsing a large body, rendering a long chat and
    tokenizing it take the event loop from every other client (/health, other streams) for as long."""
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args, **kwargs))


async def read_body(request: web.Request, state: DaemonState, kind):
    """The request's body, parsed and validated (off the event loop)."""
    return await off_loop(parse_body, await read_raw(request, state), kind)


def submit(
    model: LoadedModel,
    engine,
    body,
    ids: list[int],
    request_id: str,
    grammar=None,
    index: int = 0,
    share_prompt_with: str | None = None,
    prompt_index: int | None = None,
    prompt_param: str | None = None,
) -> None:
    """Submit one completion; a refusal becomes the API's error, naming the field and, in a batch of
    prompts (`prompt_index`), the prompt: `prompt.1`, `prompt.0.3` (its token 3). `prompt_param`: the
    field a refused prompt is named by in the API that sent it (`messages`, `input`)."""
    limit = model.info.max_model_len
    # Unset max_tokens: what fits the context (at least 1, so a prompt that fills it is refused as too long).
    default_max = max(1, min(DEFAULT_MAX_TOKENS, limit - len(ids))) if limit else DEFAULT_MAX_TOKENS
    params = body.sampling_params(default_max, model.info.generation_defaults)
    params.grammar = grammar
    if index and params.seed is not None:  # the n completions of one request draw differently, reproducibly
        params.seed = (params.seed + index) % 2**63
    try:
        engine.submit(ids, params, request_id, share_prompt_with)
    except QueueFull as exc:
        raise ApiError(exc.status, str(exc), exc.field, exc.code, "rate_limit_error", {"Retry-After": "1"}) from None
    except RequestRejected as exc:
        param, message = exc.field, str(exc)
        if param == "prompt" and (prompt_param or isinstance(body, ChatRequest)):
            param = prompt_param or "messages"  # what the API turns into the prompt
        elif param is not None and param.split(".")[0] == "prompt":
            if prompt_index is not None:
                param = f"prompt.{prompt_index}{param[len('prompt') :]}"
            message = f"{param}: {message}" if "." in param else message
        elif prompt_index is not None:
            message = f"prompt.{prompt_index}: {message}"
        raise ApiError(exc.status, message, param, exc.code) from None

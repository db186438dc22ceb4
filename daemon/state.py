"""What the daemon's handlers share: the daemon's state, the model lease, body reading off the event loop and
the one timeout error. The generation itself is pipeline.py's."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import time
from dataclasses import dataclass, field

from aiohttp import web

from .guard import IDENTITY, IDENTITY_HEADER, LOCAL, Guard, is_tcp
from .models.loaded import KeepAlive, LoadedModel, parse_keep_alive
from .models.pool import ModelPool
from .protocol import ApiError, parse_body


@dataclass
class DaemonState:
    model_name: str  # the daemon's own model (--model): what a request without a model gets
    request_timeout: float = 600.0  # wall-clock limit per request, seconds
    body_timeout: float = 30.0  # seconds to receive a request body
    reasoning_format: str = "auto"  # --reasoning-format: a thinking model's reasoning apart (auto) or not (none)
    reasoning_budget: int | None = None  # --reasoning-budget: thinking tokens at most where a request sets none
    pool: ModelPool | None = None  # the loaded models
    started_at: float = field(default_factory=time.time)
    status: str = "loading"  # loading | ready | draining | failed
    load_error: str | None = None
    replica_tag: str | None = None  # behind a cluster's ingress (server.DaemonConfig.replica_tag)
    prompt_cache_shared: bool = False  # --prompt-cache-shared: every key's requests share cached prefixes
    media_path: str | None = None  # --media-path: the folder file:// image URLs are read in (None: refused)

    def identity(self, request: web.Request) -> str:
        """Who sent `request`: the name of the key it showed (guard.IDENTITY), or, behind a cluster's ingress,
        the name the ingress's own guard gave it (the X-Minibatch-Identity header it forwards)."""
        if self.replica_tag is not None:
            return request.headers.get(IDENTITY_HEADER, LOCAL)
        return request.get(IDENTITY, LOCAL)

    def cache_salt(self, request: web.Request) -> int:
        """The prefix caches' namespace of `request`'s sender (the pool's and the disk's): each API key its
        own, so that no client can tell by its time to first token what another sent; 0 for the socket's own
        user, and for everyone with --prompt-cache-shared."""
        who = self.identity(request)
        if self.prompt_cache_shared or who == LOCAL:
            return 0
        return int.from_bytes(hashlib.blake2b(who.encode(), digest_size=8, person=b"minibatch-salt").digest(), "little")

    def check_serving(self) -> ModelPool:
        if self.status == "draining":
            raise ApiError(503, "the daemon is shutting down", None, "shutting_down", "unavailable")
        if self.pool is None or self.status == "failed":
            raise ApiError(503, f"the daemon cannot serve: {self.load_error}", None, "not_ready", "unavailable")
        return self.pool

    def lease(self, name: str | None, keep: KeepAlive | None = None):
        """The model a request names, loaded if need be and held until the request ends (`async with`);
        `keep`: the request's keep_alive (keep_alive_of), applied at the end once the request was taken."""
        return self.check_serving().lease(name, keep)

    @staticmethod
    def keep_alive_of(keep_alive, operator: bool) -> KeepAlive | None:
        """A request's keep_alive as the client sent it (None: the model's own), or a 400 naming the field;
        `operator`: the request is the operator's own (is_operator), which may change a preloaded model's
        lifetime."""
        return None if keep_alive is None else KeepAlive(parse_keep_alive(keep_alive), operator)

    def is_operator(self, request: web.Request) -> bool:
        """The daemon's own user: a request over the Unix socket (private to that user) that showed no key.
        Only such a request changes the lifetime of the models the operator loaded."""
        return self.replica_tag is None and not is_tcp(request) and request.get(IDENTITY, LOCAL) == LOCAL

    def served(self, name: str | None) -> LoadedModel:
        """A loaded model for the engine endpoints (?model=; without it, the daemon's own)."""
        return self.check_serving().served(name)


STATE = web.AppKey("state", DaemonState)
GUARD = web.AppKey("guard", Guard)


async def read_raw(request: web.Request, state: DaemonState) -> bytes:
    """The request body, or 408 when the client takes longer than the body timeout to send it. Under a timeout
    scope, not wait_for: Python 3.11's wait_for returns the body when the handler is cancelled just as it came
    (a client gone right after sending), and the request would then run to its end for nobody."""
    try:
        async with asyncio.timeout(state.body_timeout):
            return await request.read()
    except TimeoutError:
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

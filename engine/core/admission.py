"""Admission: the one place that decides whether a request may enter the scheduler.

Every refusal is a `RequestRejected` carrying the field it is about, the HTTP status and a stable error
code, so an API maps it without reading the message. The checks run once, where the request is submitted
(`AsyncEngine.submit` on the event loop, `LLMEngine.add_request` in-process); nothing outside repeats them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # type names only: none of these modules imports this one
    from minibatch.engine.core.block_manager import BlockManager
    from minibatch.engine.core.config import SchedulerConfig
    from minibatch.engine.core.request import Request


class RequestRejected(ValueError):
    """The request cannot enter: `field` is what it is about, `code` a stable name for the reason. A message
    that names its own field is given as a function of the name (`said_as` writes it in the client's)."""

    def __init__(
        self,
        message: str | Callable[[str], str],
        field_name: str | None = "prompt",
        code: str = "rejected",
        status: int = 400,
    ):
        self._say = message if callable(message) else None
        super().__init__(message(field_name or "") if callable(message) else message)
        self.field = field_name
        self.code = code
        self.status = status

    def said_as(self, name: str) -> str:
        """The message with its field called `name` (an API's own word for it: n_predict, num_predict)."""
        return self._say(name) if self._say is not None else str(self)


class QueueFull(RequestRejected):
    """Every slot and every place in the queue is taken; try again later (HTTP 429)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, None, "queue_full", 429)


def check_request(req: Request, config: SchedulerConfig, blocks: BlockManager) -> None:
    """Raise RequestRejected if the request could never run: empty, a token id outside the vocabulary, longer than
    the context, larger than the cache."""
    if not req.prompt_token_ids:
        raise RequestRejected("the prompt is empty", "prompt", "empty_prompt")
    vocab = config.vocab_size
    if vocab is not None:
        bad = next((i for i, t in enumerate(req.prompt_token_ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestRejected(
                f"token id {req.prompt_token_ids[bad]} is out of range [0, {vocab})", f"prompt.{bad}", "invalid_token"
            )
        bias = req.params.logit_bias or {}
        bad = next((t for t in bias if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestRejected(f"token id {bad} is out of range [0, {vocab})", f"logit_bias.{bad}", "invalid_token")
    limit = config.max_model_len
    if req.num_prompt_tokens >= limit:
        raise RequestRejected(
            f"the prompt has {req.num_prompt_tokens} tokens; the context limit is {limit}",
            "prompt",
            "context_length_exceeded",
        )
    if req.max_total_tokens > limit:
        raise RequestRejected(
            lambda name: (
                f"prompt ({req.num_prompt_tokens} tokens) + {name} ({req.params.max_tokens}) = "
                f"{req.max_total_tokens} exceeds the context limit of {limit} tokens"
            ),
            "max_tokens",
            "context_length_exceeded",
        )
    need = blocks.blocks_needed(req.max_total_tokens)
    if need > blocks.num_usable_blocks:
        raise RequestRejected(
            lambda name: (
                f"prompt + {name} = {req.max_total_tokens} tokens needs {need} KV blocks but the whole "
                f"cache has {blocks.num_usable_blocks}; it could never run"
            ),
            "max_tokens",
            "kv_cache_exceeded",
        )


def check_capacity(config: SchedulerConfig, in_flight: int) -> None:
    """Raise QueueFull when `in_flight` requests already fill the batch and the queue behind it.

    `max_queue` means one thing: requests that may wait behind a full batch, so at most
    `max_num_seqs + max_queue` are in flight (running or waiting); None is no cap.
    """
    cap = config.max_queue
    if cap is not None and in_flight >= config.max_num_seqs + cap:
        raise QueueFull(
            f"the waiting queue is full ({cap} requests waiting behind {config.max_num_seqs} running); retry later"
        )

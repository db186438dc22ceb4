"""A request's state as it moves through the engine, and the timings derived from it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

from minibatch.engine.core.sampling_params import SamplingParams
from minibatch.engine.lora.names import LoraUses

if TYPE_CHECKING:  # (the core imports no torch: the runner reads an image's embeddings)
    import torch

# How an embedding request pools its prompt's hidden states: the last position's, their mean, the first's; or
# "rank": a cross-encoder's classification head over the first (a query and document pair's relevance).
POOLINGS = ("last", "mean", "cls", "rank")


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """An image in a prompt: the run of placeholder positions [offset, offset + len(embeds)) whose input
    embeddings are the image's (its vision tower's output, [n, hidden]) instead of the placeholder token's.
    `key`: from the image's content hash. The prefix caches key those positions by it, not by the placeholder
    ids: two images never share a block, the same image sent again is a hit."""

    offset: int
    embeds: torch.Tensor
    key: int
    # its positions attend to each other, later ones too (Gemma 3's images): computed in one forward, never
    # cut by a chunk (the runner passes the span to attention)
    whole: bool = False

    @property
    def end(self) -> int:
        return self.offset + self.embeds.shape[0]


def check_images(images: tuple[ImageSpan, ...], prompt_len: int) -> None:
    """A ValueError unless the images are in order, apart and within the prompt."""
    end = 0
    for span in images:
        if span.offset < end or span.end > prompt_len:
            raise ValueError(f"image at {span.offset}: images must be in order, apart and within the prompt")
        end = span.end


class RequestStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue; its KV will be recomputed
    FINISHED_STOPPED = 3  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = 4  # max_tokens or the model's context
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {3: "stop", 4: "length", 5: "abort"}.get(int(self))


@dataclass(slots=True, eq=False)  # identity equality: the queues test membership often
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_disk_cached_tokens: int = 0  # of them, read from the second tier (kv_tier.py) first
    # The prefix caches' namespace: its first block's hash chains from it, so requests of different salts
    # never share a block (the daemon gives each API key its own unless sharing is allowed)
    cache_salt: int = 0
    tier_checked: bool = False  # its prefix was looked up in the second tier since it was last queued
    # It may start from a recent prompt's K/V moved to new positions (kv_reuse.py: not what computing its prompt
    # gives; fill-in-the-middle requests); num_reused_tokens: rows it took so at its first admission
    reuse_shifted: bool = False
    num_reused_tokens: int = 0
    # Spans [start, end) past num_computed_tokens whose K/V it holds already (rows shifted reuse copied, after a
    # gap it computes first): a chunk stops at the next one, and the computed count jumps over it
    held: list[tuple[int, int]] = field(default_factory=list)
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    prompt_progress_time: float | None = None  # when a chunk of its prompt was last computed (time.monotonic)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    # per output token (when params.logprobs is set): (its log-probability, [(token, log-probability)] of the top k)
    output_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    finished_time: float | None = None
    error: str | None = None
    # n > 1: the sibling that prefills the shared prompt; this one borrows its full prompt blocks once computed
    prompt_leader: Request | None = field(default=None, repr=False)
    # speculative decoding: the tokens proposed for the next step (set before each schedule, consumed by it)
    draft_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0  # draft tokens verified for it so far
    num_accepted_tokens: int = 0  # of them accepted
    # An embedding request: its prompt is computed like any other's, then it ends with the prompt's hidden
    # states pooled ("last": the last token's, "mean": every token's, "cls": the first's) instead of a next token.
    pooling: str | None = None
    embedding: list[float] | None = None
    loras: LoraUses = ()  # the LoRA adapters it runs under and their scales (lora/names.py); none: the base model
    images: tuple[ImageSpan, ...] = ()  # its prompt's images, in order, apart

    @property
    def computes_every_position(self) -> bool:
        """Its pooling reads hidden states before the last position: no prefix-cache hit may skip one."""
        return self.pooling in ("mean", "cls", "rank")

    def chunk(self, start: int, n: int) -> int:
        """How many of the `n` tokens from `start` one forward may compute: fewer where the last would cut a
        whole image (up to its first position instead; 0 when the chunk starts inside it and cannot reach its
        end, so it waits for a step with room)."""
        for span in self.images:
            if span.whole and span.offset < start + n < span.end:
                return max(0, span.offset - start)
        return n

    def takes_image(self, start: int, n: int) -> bool:
        """Whether its tokens [start, start + n) hold any of its images' positions."""
        return any(span.offset < start + n and start < span.end for span in self.images)

    def key_tokens(self, start: int, end: int) -> tuple[int, ...]:
        """Its tokens [start, end) as the prefix caches key them: an image's positions by the image (negative
        values from its key and the position within it: never a token id), the rest by their token ids."""
        tokens = self.tokens(start, end)
        for span in self.images:
            for pos in range(max(start, span.offset), min(end, span.end)):
                tokens[pos - start] = -1 - ((span.key + pos - span.offset) & 0x3FFFFFFF)
        return tuple(tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_to_compute(self) -> int:
        """Tokens it computes before it must stop: up to its next held span, else all it has."""
        end = self.held[0][0] if self.held else len(self.prompt_token_ids) + len(self.output_token_ids)
        return end - self.num_computed_tokens

    def advance(self, n: int) -> None:
        """`n` more tokens are computed; a held span reached is passed over."""
        if n > 0 and self.num_computed_tokens < len(self.prompt_token_ids):
            self.prompt_progress_time = time.monotonic()
        self.num_computed_tokens += n
        while self.held and self.held[0][0] <= self.num_computed_tokens:
            self.num_computed_tokens = max(self.num_computed_tokens, self.held.pop(0)[1])

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this request can ever hold: prompt + max_tokens."""
        return len(self.prompt_token_ids) + self.params.max_tokens

    def append_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        self.token_times.append(now)
        if self.first_token_time is None:
            self.first_token_time = now

    def metrics(self) -> RequestMetrics:
        return RequestMetrics.of(self)


@dataclass(slots=True, frozen=True)
class RequestMetrics:
    """Timings in seconds (None until the event happened)."""

    queue_wait: float | None  # arrival -> first scheduled
    ttft: float | None  # arrival -> first token
    tpot: float | None  # mean time per output token after the first
    e2e: float | None  # arrival -> finished
    prefill_time: float | None  # first scheduled -> first token
    decode_time: float | None  # first token -> last token
    prompt_tokens: int
    output_tokens: int
    cached_prompt_tokens: int
    preemptions: int
    disk_cached_prompt_tokens: int = 0  # of the cached ones, read from the disk tier for this request
    reused_prompt_tokens: int = 0  # of the cached ones, taken from a recent prompt at shifted positions
    draft_tokens: int = 0  # speculative decoding: tokens proposed and verified
    accepted_tokens: int = 0  # of them accepted (each saved a step)

    @classmethod
    def of(cls, r: Request) -> RequestMetrics:
        def since(t0, t1):
            return None if t0 is None or t1 is None else t1 - t0

        last = r.token_times[-1] if r.token_times else None
        n = len(r.output_token_ids)
        decode = since(r.first_token_time, last)
        return cls(
            queue_wait=since(r.arrival_time, r.first_scheduled_time),
            ttft=since(r.arrival_time, r.first_token_time),
            tpot=decode / (n - 1) if decode is not None and n > 1 else None,
            e2e=since(r.arrival_time, r.finished_time),
            prefill_time=since(r.first_scheduled_time, r.first_token_time),
            decode_time=decode,
            prompt_tokens=r.num_prompt_tokens,
            output_tokens=n,
            cached_prompt_tokens=r.num_cached_tokens,
            preemptions=r.num_preemptions,
            disk_cached_prompt_tokens=r.num_disk_cached_tokens,
            reused_prompt_tokens=r.num_reused_tokens,
            draft_tokens=r.num_draft_tokens,
            accepted_tokens=r.num_accepted_tokens,
        )

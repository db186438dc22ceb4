"""What the engine hands out: per-request deltas and per-step statistics."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from minibatch.engine.core.request import RequestMetrics

# A field that counts (requests, tokens, blocks): several engines' figures add up, so the cluster's view and the
# daemon's totals over its models sum exactly the fields marked so (`counts`); the others are states (a mode),
# times or ratios, which each aggregate says how to combine.
COUNT = {"across": "sum"}


def counts(cls) -> tuple[str, ...]:
    """The fields of a stats dataclass (StepStats, EngineState) marked COUNT, in their order."""
    return tuple(f.name for f in fields(cls) if f.metadata.get("across") == "sum")


# A token's log-probability and the k most likely alternatives there, as (token, log-probability).
TokenLogprob = tuple[float, list[tuple[int, float]]]


class StepAbandoned(Exception):
    """A forward stopped between layers: every request it computed for was aborted while it ran."""


@dataclass(slots=True)
class RunnerOutput:
    """What a runner's step returns (torch-free): per request that reached its last token, the tokens it
    takes in order (a verify row: its accepted draft tokens, then the model's own next token)."""

    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # per taken token, when asked for
    embeddings: dict[str, list[float]] = field(default_factory=dict)  # per embedding request that ended its prompt


@dataclass(slots=True)
class RequestOutput:
    """New text and tokens for one request since its previous output."""

    request_id: str
    text: str  # the new text (never half a character; stop strings excluded)
    token_ids: list[int]  # the new token ids
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    metrics: RequestMetrics | None = None  # set on the final output
    error: str | None = None  # set when the request ended because the engine failed
    logprobs: list[TokenLogprob] | None = None  # per token in token_ids, when asked for
    embedding: list[float] | None = None  # an embedding request's pooled hidden state, on its final output


def merge_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one, as if its tokens had come in a single step (a paced stream
    sends what came within its interval at once). The last output's end, metrics and error stand."""
    if len(outs) == 1:
        return outs[0]
    last = outs[-1]
    logprobs = None
    if any(o.logprobs is not None for o in outs):
        logprobs = [lp for o in outs for lp in o.logprobs or []]
    return RequestOutput(
        last.request_id,
        "".join(o.text for o in outs),
        [t for o in outs for t in o.token_ids],
        last.finished,
        last.finish_reason,
        last.metrics,
        last.error,
        logprobs,
        last.embedding,
    )


@dataclass(slots=True, frozen=True)
class StepStats:
    """One engine step, as the stats endpoint, the event stream and the TUI see it."""

    step: int
    timestamp: float  # wall clock (time.time()) at the end of the step
    mode: str  # "continuous" | "static"
    pending_mode: str | None  # a requested switch waiting for the batch boundary
    running: int = field(metadata=COUNT)  # requests in the batch (static: including finished members still padding)
    max_num_seqs: int = field(metadata=COUNT)
    waiting: int = field(metadata=COUNT)
    prefill_tokens: int = field(metadata=COUNT)
    decode_tokens: int = field(metadata=COUNT)
    padding_rows: int = field(metadata=COUNT)  # static: finished members' rows computed anyway this step
    kv_blocks_used: int = field(metadata=COUNT)
    kv_blocks_total: int = field(metadata=COUNT)
    prefix_hit_blocks: int = field(metadata=COUNT)  # blocks taken from the prefix cache this step
    preemptions: int = field(metadata=COUNT)  # this step
    wasted_row_steps: int = field(metadata=COUNT)  # static: padding rows so far, over the engine's life
    total_preemptions: int = field(metadata=COUNT)
    step_time: float  # seconds, schedule + forward + sampling + bookkeeping
    # seconds the engine's threads, together, were ready to run but waited for a core since the previous
    # step ended (cpu_wait.py): the machine busy elsewhere; None where the system does not count it
    cpu_wait: float | None = None
    draft_tokens: int = field(default=0, metadata=COUNT)  # speculative tokens verified this step
    accepted_tokens: int = field(default=0, metadata=COUNT)  # of them accepted
    verify_rows: int = field(default=0, metadata=COUNT)  # rows that verified a draft
    disk_hit_blocks: int = field(default=0, metadata=COUNT)  # blocks read back from the disk tier for this step
    reused_tokens: int = field(default=0, metadata=COUNT)  # rows shifted reuse copied this step (core/kv_reuse.py)

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(slots=True, frozen=True)
class EngineState:
    """The engine as it stands between two steps: made on the engine thread after every step and every
    change it applies (mode switch, abort), and swapped in whole, so another thread reads a consistent one."""

    step: int  # steps run so far
    timestamp: float  # wall clock when it was taken
    mode: str
    pending_mode: str | None
    running: int = field(metadata=COUNT)
    max_num_seqs: int = field(metadata=COUNT)
    waiting: int = field(metadata=COUNT)
    kv_blocks_used: int = field(metadata=COUNT)
    kv_blocks_total: int = field(metadata=COUNT)
    block_size: int
    kv_window: int  # > 0: blocks out of every layer's sliding window are handed back early
    kv_blocks_released_out_of_window: int = field(metadata=COUNT)  # over the engine's life
    prefix_cache_hit_blocks: int = field(metadata=COUNT)  # over the engine's life
    preemptions: int = field(metadata=COUNT)  # over the engine's life
    wasted_row_steps: int = field(metadata=COUNT)  # static mode's padding rows, over the engine's life
    speculative: str = "off"  # the proposer (spec_decode/config.py SPEC_METHODS)
    draft_tokens: int = field(default=0, metadata=COUNT)  # speculative tokens verified, over the engine's life
    accepted_tokens: int = field(default=0, metadata=COUNT)  # of them accepted
    verify_rows: int = field(default=0, metadata=COUNT)  # row-steps that verified a draft, over the engine's life
    reused_tokens: int = field(default=0, metadata=COUNT)  # rows shifted reuse copied, over the engine's life
    # The disk tier of the prefix cache (--prompt-cache-gb; kv_offload/): over the engine's life
    disk_cache: bool = False  # whether it is on for this model
    disk_hit_blocks: int = field(default=0, metadata=COUNT)  # blocks read back intact (prefix hits from disk)
    disk_loading_requests: int = field(default=0, metadata=COUNT)  # requests waiting for their blocks now
    disk_read_bytes: int = field(default=0, metadata=COUNT)
    disk_written_blocks: int = field(default=0, metadata=COUNT)
    disk_written_bytes: int = field(default=0, metadata=COUNT)
    disk_bad_blocks: int = field(default=0, metadata=COUNT)  # torn, corrupt or vanished files: misses, removed
    disk_write_errors: int = field(default=0, metadata=COUNT)  # failed writes (full or read-only disk): misses
    disk_skipped_blocks: int = field(default=0, metadata=COUNT)  # offered while the writer was behind: not kept

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

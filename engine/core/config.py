"""The scheduler's limits and the batching modes, in one place (the factory, the policies and the API read them)."""

from __future__ import annotations

from dataclasses import dataclass, fields

MODES = ("continuous", "static")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 32  # running requests at most (static: the batch size)
    max_num_batched_tokens: int = 512  # tokens per forward (continuous mode)
    max_model_len: int = 2048  # prompt + max_tokens at most
    max_wait_ms: float = 50.0  # static mode: the longest a batch waits to fill up
    max_queue: int | None = None  # requests that may wait behind a full batch (admission.check_capacity)
    vocab_size: int | None = None  # token ids must be below it (prompts, logit_bias); None: not checked
    # Shifted reuse for the requests that allow it (kv_reuse.py): the shortest run of a recent prompt taken at a
    # new position (llama-server's --cache-reuse); 0: off
    cache_reuse: int = 64
    # and the first tokens of each such run after a change are computed, not moved (kv_reuse.plan_runs)
    cache_reuse_settle: int = 16
    # An encoder's inputs attend both ways: each is computed whole in one step, never in chunks (the token budget
    # then holds the longest input: the factory raises it to max_model_len)
    whole_prompts: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running request can decode each step"
            )
        if self.cache_reuse < 0:
            raise ValueError(f"cache_reuse must be 0 (off) or more, got {self.cache_reuse}")
        if self.cache_reuse_settle < 0:
            raise ValueError(f"cache_reuse_settle must be 0 or more, got {self.cache_reuse_settle}")
        if self.max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {self.max_wait_ms}")


# Each limit's default, read by EngineConfig (engine/factory.py) so the daemon's options default to these.
SCHEDULER_DEFAULTS = {f.name: f.default for f in fields(SchedulerConfig)}

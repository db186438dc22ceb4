"""The speculative-decoding options, defined once: the CLI, the engine config and the API read them here."""

from __future__ import annotations

from dataclasses import dataclass

# off: one token per row per step; ngram: prompt lookup (ngram.py); draft: a smaller model (draft_model.py)
SPEC_METHODS = ("off", "ngram", "draft")
DEFAULT_METHOD = "ngram"
DEFAULT_NUM_TOKENS = 4  # draft tokens per row per step at most (draft_length.py picks fewer when they do not pay)
MAX_NUM_TOKENS = 16
NGRAM_MIN, NGRAM_MAX = 1, 4  # the suffix lengths the proposer looks up, longest first


@dataclass(slots=True, frozen=True)
class SpecConfig:
    method: str = DEFAULT_METHOD
    num_tokens: int = DEFAULT_NUM_TOKENS
    ngram_min: int = NGRAM_MIN
    ngram_max: int = NGRAM_MAX
    draft_model: str | None = None  # draft: any model spec --model takes, sharing the target's vocabulary

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative must be one of {', '.join(SPEC_METHODS)}, got {self.method!r}")
        n = self.num_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_NUM_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_NUM_TOKENS}], got {n!r}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative draft needs a draft model (--draft-model SPEC)")
        if self.draft_model and self.method != "draft":
            raise ValueError(
                f"draft_model {self.draft_model!r} is used only with speculative draft, got {self.method!r}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram sizes must satisfy 1 <= min <= max, got {self.ngram_min}..{self.ngram_max}")

    @property
    def enabled(self) -> bool:
        return self.method != "off"

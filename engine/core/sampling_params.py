"""Per-request sampling and stopping settings, validated on construction (no torch here)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np

# The fields a model's generation_config.json may give defaults for (as vLLM reads them).
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# Tokens a request generates when it sets no limit: the one default of every API and the chat (the daemon
# lowers it to what fits the model's context).
DEFAULT_MAX_TOKENS = 1024
MAX_LOGPROBS = 20  # alternatives per token at most, as OpenAI allows
MAX_TOP_K = 1_000_000  # far above any vocabulary; bounds the tensor the sampler builds
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily
MAX_LOGIT_BIAS = 300  # entries per request at most, as OpenAI allows
LOGIT_BIAS_RANGE = 100.0  # each bias in [-100, 100]


class GrammarState(Protocol):
    """One request's constrained-decoding state (engine/text/structured.py's Grammar is the real one)."""

    def fill_mask(self, words: np.ndarray) -> None:
        """Write the allowed next tokens into `words` (int32, one bit per token)."""

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False when it was not allowed."""

    def is_done(self) -> bool:
        """Nothing more can follow."""

    def validate(self, tokens: list[int]) -> int:
        """How many of `tokens` it would take from here, without advancing."""

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens."""


class InvalidParameterError(ValueError):
    """A sampling parameter is out of range; `field` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop. Greedy when temperature is 0."""

    temperature: float = 1.0
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p; in (0, 1]
    top_k: int = -1  # keep the k most likely tokens; -1 (or 0) keeps all
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one; in [0, 1]
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or output
    presence_penalty: float = 0.0  # in [-2, 2], subtracted once from tokens already in the output
    frequency_penalty: float = 0.0  # in [-2, 2], subtracted per occurrence in the output
    seed: int | None = None  # same seed -> same tokens, whatever else is in the batch
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: list[str] = field(default_factory=list)  # stop strings, matched on the text, not included
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: each token's log-probability and the k most likely alternatives
    # token id -> added to its logit before sampling (-100 all but bans it, 100 all but forces it)
    logit_bias: dict[int, float] | None = None
    # Constrained decoding: the request only takes tokens its grammar allows and ends when it is complete.
    grammar: GrammarState | None = field(default=None, repr=False, compare=False)
    speculative: bool = True  # may verify draft tokens when the engine speculates (the answer is the same)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        # Below this, dividing the logits overflows them; argmax is what such a temperature means anyway.
        return self.temperature < GREEDY_BELOW

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self) -> None:
        _number("temperature", self.temperature, lo=0.0, hi=100.0)
        _number("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _integer("top_k", self.top_k, lo=-1, hi=MAX_TOP_K)
        _number("min_p", self.min_p, lo=0.0, hi=1.0)
        _number("repetition_penalty", self.repetition_penalty, lo=0.0, hi=10.0, lo_open=True)
        _number("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _number("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        if self.seed is not None:
            _integer("seed", self.seed, lo=0, hi=2**63 - 1)
        _integer("max_tokens", self.max_tokens, lo=1)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidParameterError("stop", "must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > 16:
            raise InvalidParameterError("stop", f"at most 16 stop strings, got {len(self.stop)}")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise InvalidParameterError("stop_token_ids", "must be a list of non-negative integers")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidParameterError("ignore_eos", "must be a boolean")
        if not isinstance(self.speculative, bool):
            raise InvalidParameterError("speculative", f"must be a boolean, got {self.speculative!r}")
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise InvalidParameterError("logit_bias", f"must map at most {MAX_LOGIT_BIAS} token ids to biases")
            for token, bias in self.logit_bias.items():
                if not _is_int(token) or token < 0:
                    raise InvalidParameterError("logit_bias", f"keys must be token ids (>= 0), got {token!r}")
                _number(f"logit_bias.{token}", bias, lo=-LOGIT_BIAS_RANGE, hi=LOGIT_BIAS_RANGE)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(name: str, v, lo: float, hi: float, lo_open: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise InvalidParameterError(name, f"must be a finite number, got {v!r}")
    if (v <= lo if lo_open else v < lo) or v > hi:
        left = "(" if lo_open else "["
        raise InvalidParameterError(name, f"must be in {left}{lo:g}, {hi:g}], got {v!r}")


def _integer(name: str, v, lo: int, hi: int | None = None) -> None:
    if not _is_int(v):
        raise InvalidParameterError(name, f"must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise InvalidParameterError(name, f"must be {bound}, got {v!r}")

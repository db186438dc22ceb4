"""Per-request sampling and stopping settings, validated on construction (no torch here)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np

# The fields a model's generation_config.json may give defaults for (as vLLM reads them, and the samplers a
# GGUF's general.sampling.* may set).
SAMPLING_DEFAULT_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "xtc_probability",
    "xtc_threshold",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
)
# Tokens a request generates when it sets no limit: the one default of every API and the chat (the daemon
# lowers it to what fits the model's context).
DEFAULT_MAX_TOKENS = 1024
MAX_LOGPROBS = 20  # alternatives per token at most, as OpenAI allows
MAX_TOP_K = 1_000_000  # far above any vocabulary; bounds the tensor the sampler builds
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily
MAX_LOGIT_BIAS = 300  # entries per request at most, as OpenAI allows
LOGIT_BIAS_RANGE = 100.0  # each bias in [-100, 100]
DRY_BREAKERS = ("\n", ":", '"', "*")  # llama-server's default sequence breakers
MAX_DRY_BREAKERS = 16  # breaker strings per request at most, each of at most MAX_DRY_BREAKER_CHARS
MAX_DRY_BREAKER_CHARS = 40
MAX_CONTEXT_TOKENS = 1 << 24  # a bound for counts of tokens (dry_penalty_last_n) far past any context


@dataclass(frozen=True, slots=True)
class Bound:
    """A numeric setting's range: [lo, hi], or (lo, hi] when lo_open; integer-valued when `integer`."""

    lo: float
    hi: float
    integer: bool = False
    lo_open: bool = False


# The samplers beyond the common five (llama-server's names and ranges): SamplingParams checks each against
# its bound, and the faces' schemas (OpenAI-style bodies, Ollama's options) take their fields from here.
EXTRA_SAMPLERS: dict[str, Bound] = {
    "typical_p": Bound(0.0, 1.0, lo_open=True),
    "top_n_sigma": Bound(-1.0, 100.0),
    "xtc_probability": Bound(0.0, 1.0),
    "xtc_threshold": Bound(0.0, 1.0),
    "dry_multiplier": Bound(0.0, 100.0),
    "dry_base": Bound(1.0, 100.0),
    "dry_allowed_length": Bound(1, MAX_CONTEXT_TOKENS, integer=True),
    "dry_penalty_last_n": Bound(-1, MAX_CONTEXT_TOKENS, integer=True),
    "mirostat": Bound(0, 2, integer=True),
    "mirostat_tau": Bound(0.0, 100.0),
    "mirostat_eta": Bound(0.0, 1.0),
}


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
    # The samplers llama-server adds (its names, ranges and defaults; each off by default and free when off):
    typical_p: float = 1.0  # keep the tokens whose surprise is nearest the entropy, up to this mass; 1: off
    top_n_sigma: float = -1.0  # keep the logits within n standard deviations of the top; <= 0: off
    xtc_probability: float = 0.0  # how often to exclude the top choices: all over the threshold but the least
    xtc_threshold: float = 0.1  # ... likely of them, when at least two are; above 0.5: off
    dry_multiplier: float = 0.0  # DRY: a token that would extend a repeat of the text is penalised; 0: off
    dry_base: float = 1.75  # ... by multiplier x base^(repeat length - allowed length)
    dry_allowed_length: int = 2  # repeats this long go unpenalised
    dry_penalty_last_n: int = -1  # how many of the last tokens are searched; -1: the whole context, 0: off
    dry_sequence_breakers: list[str] = field(default_factory=lambda: list(DRY_BREAKERS))  # a repeat never spans these
    mirostat: int = 0  # 2: Mirostat 2.0 (its surprise target replaces top-k, typical, top-p, min-p and XTC); 0: off
    mirostat_tau: float = 5.0  # the target surprise, in bits
    mirostat_eta: float = 0.1  # how fast the truncation follows the surprise it observes
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

    @property
    def needs_dry(self) -> bool:
        return self.dry_multiplier > 0.0 and self.dry_penalty_last_n != 0

    @property
    def needs_chain(self) -> bool:
        """A sampled row with a sampler the fused pass does not hold (engine/runner/chain.py draws it)."""
        return not self.greedy and (
            self.typical_p < 1.0
            or self.top_n_sigma > 0.0
            or (self.xtc_probability > 0.0 and self.xtc_threshold <= 0.5)
            or self.mirostat != 0
        )

    def validate(self) -> None:
        _number("temperature", self.temperature, lo=0.0, hi=100.0)
        _number("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _integer("top_k", self.top_k, lo=-1, hi=MAX_TOP_K)
        _number("min_p", self.min_p, lo=0.0, hi=1.0)
        _number("repetition_penalty", self.repetition_penalty, lo=0.0, hi=10.0, lo_open=True)
        _number("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _number("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        for name, bound in EXTRA_SAMPLERS.items():
            if bound.integer:
                _integer(name, getattr(self, name), lo=int(bound.lo), hi=int(bound.hi))
            else:
                _number(name, getattr(self, name), lo=bound.lo, hi=bound.hi, lo_open=bound.lo_open)
        if isinstance(self.dry_sequence_breakers, tuple):
            self.dry_sequence_breakers = list(self.dry_sequence_breakers)
        breakers = self.dry_sequence_breakers
        if (
            not isinstance(breakers, list)
            or len(breakers) > MAX_DRY_BREAKERS
            or not all(isinstance(b, str) and 0 < len(b) <= MAX_DRY_BREAKER_CHARS for b in breakers)
        ):
            raise InvalidParameterError(
                "dry_sequence_breakers",
                f"must be a list of at most {MAX_DRY_BREAKERS} non-empty strings of at most "
                f"{MAX_DRY_BREAKER_CHARS} characters",
            )
        if self.mirostat == 1:
            raise InvalidParameterError("mirostat", "only 0 (off) and 2 (Mirostat 2.0) are supported, got 1")
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

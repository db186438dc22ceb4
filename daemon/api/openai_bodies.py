"""Request bodies of OpenAI's Chat Completions and Completions, validated with pydantic.

Unknown fields are refused (a typo must not be silently ignored); types are strict (no "1" for 1); NaN and
Infinity are refused. Each error names its field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictStr, WithJsonSchema

from minibatch.engine.core.sampling_params import (
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_TOP_K,
)
from minibatch.engine.text.fim import Infill
from minibatch.engine.text.structured import MAX_GRAMMAR_BYTES

from ..generation.loras import MAX_ENTRIES, LoraScale
from ..generation.reasoning import EFFORTS
from ..protocol import ApiError, Float, Int
from .messages import MAX_TOOLS, Body, Message, NamedToolChoice, Tool
from .samplers import given_samplers, sampler_fields

TokenIdKey = Annotated[StrictStr, Field(pattern=r"^(0|[1-9][0-9]{0,8})$")]  # a token id as a JSON object key
Bias = Annotated[float, Field(ge=-LOGIT_BIAS_RANGE, le=LOGIT_BIAS_RANGE, allow_inf_nan=False)]
MAX_PROMPTS = 64  # prompts in one /v1/completions request at most
LOGIT_BIAS_SCHEMA = {
    "anyOf": [
        {
            "type": "object",
            "propertyNames": {"pattern": "^(0|[1-9][0-9]{0,8})$"},
            "additionalProperties": {"type": "number", "minimum": -LOGIT_BIAS_RANGE, "maximum": LOGIT_BIAS_RANGE},
            "maxProperties": MAX_LOGIT_BIAS,
        },
        {"type": "null"},
    ],
    "description": "token id (a string key) -> a bias added to its logit before sampling",
}


MAX_N = 8
# the body's fields that are SamplingParams' fields of the same name
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "max_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "speculative",
    "logit_bias",
)


MAX_STREAM_INTERVAL_MS = 1000


class StreamOptions(Body):
    include_usage: StrictBool = False
    # the least time between two chunks of the stream: text that comes sooner goes out in the next chunk,
    # merged (the first token and the end are never held); a client that draws a few times a second asks
    # for that and reads a few chunks a second instead of one per token
    interval_ms: Int = Field(default=0, ge=0, le=MAX_STREAM_INTERVAL_MS)


class JsonSchemaFormat(Body):
    name: StrictStr = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None
    description: StrictStr | None = None


class ResponseFormat(Body):
    """OpenAI's response_format: plain text, any JSON object, or JSON that follows a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(sampler_fields(Body, "_Samplers")):
    model: StrictStr | None = None
    lora: list[LoraScale] | None = Field(default=None, max_length=MAX_ENTRIES)  # llama-server's: ids and scales
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: Int | None = Field(default=None, ge=1)
    temperature: Float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: Float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: Int = Field(default=-1, ge=-1, le=MAX_TOP_K)
    min_p: Float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: Float = Field(default=1.0, gt=0.0, le=2.0)
    presence_penalty: Float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: Float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: Int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[Annotated[Int, Field(ge=0)]] | None = None
    ignore_eos: StrictBool = False
    speculative: StrictBool = True  # false: this request never verifies draft tokens (the answer is the same)
    n: Int = Field(default=1, ge=1, le=MAX_N)  # completions per request; the prompt is computed once
    user: StrictStr | None = None
    response_format: ResponseFormat | None = None
    # llama-server's: the answer follows this grammar, llama.cpp's GBNF (rules with ::=, from root) or Lark (from start)
    grammar: StrictStr | None = Field(default=None, min_length=1, max_length=MAX_GRAMMAR_BYTES)
    # OpenAI's logit_bias: token id (as a string key) -> bias added to its logit before sampling
    logit_bias: Annotated[dict[TokenIdKey, Bias] | None, WithJsonSchema(LOGIT_BIAS_SCHEMA)] = Field(
        default=None, max_length=MAX_LOGIT_BIAS
    )

    def sampling(self) -> tuple[dict, dict]:
        """(what the request set, the API's defaults for the rest), in SamplingParams' names: the pipeline puts
        the model's defaults between them."""
        values = {f: getattr(self, f) for f in _SAMPLING_FIELDS}
        values["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        values["stop_token_ids"] = list(self.stop_token_ids or [])
        values["logit_bias"] = {int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None
        values["logprobs"] = self.logprobs_k()
        given = self.model_fields_set | {"logprobs"}
        return {k: v for k, v in values.items() if k in given} | given_samplers(self), {
            k: v for k, v in values.items() if k not in given
        }

    def logprobs_k(self) -> int | None:
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def stream_interval(self) -> float:
        """Seconds between a stream's chunks (stream_options.interval_ms); 0: a chunk per engine step."""
        return self.stream_options.interval_ms / 1000 if self.stream and self.stream_options else 0.0


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1, max_length=1000)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    logprobs: StrictBool = (
        False  # each output token's log-probability (of the model's logits, before sampling settings)
    )
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # a thinking model's reasoning: apart in message.reasoning_content (auto), or left in the content (none)
    reasoning_format: Literal["auto", "none"] | None = None
    # a thinking model's level: a budget of thinking tokens (generation/reasoning.py's EFFORT_BUDGETS), "none"
    # no thinking; a template that reads reasoning_effort (gpt-oss) is handed it
    reasoning_effort: Literal[EFFORTS] | None = None
    # thinking tokens at most, then the thinking is closed and the answer (its format or tool call) follows
    max_reasoning_tokens: Int | None = Field(default=None, ge=0)
    # the chat template's own switches (vLLM's and llama-server's): enable_thinking false turns thinking off
    chat_template_kwargs: dict[StrictStr, Any] | None = None

    def logprobs_k(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs set to true", "top_logprobs", "invalid_value")
        return (self.top_logprobs or 0) if self.logprobs else None


TOKEN_LIST = {"type": "array", "items": {"type": "integer", "minimum": 0}}  # openapi.py adds the vocabulary bound
PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {**TOKEN_LIST, "minItems": 1, "description": "token ids"},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_PROMPTS},
        {"type": "array", "items": {**TOKEN_LIST, "minItems": 1}, "minItems": 1, "maxItems": MAX_PROMPTS},
    ],
    "description": "a text, a list of token ids, or a batch: a list of texts or of token-id lists",
}


class CompletionRequest(_Sampling):
    # Checked by `prompts()`, which names the element at fault (prompt.1, prompt.0.3).
    prompt: Annotated[Any, WithJsonSchema(PROMPT_SCHEMA)]
    # fill in the middle: the prompt is the text before the gap, this the text after it (a coder model's)
    suffix: StrictStr | None = None
    echo: Literal[False] | None = None
    logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # the legacy API: k alternatives per token

    def logprobs_k(self) -> int | None:
        return self.logprobs

    def fill(self) -> Infill | None:
        """With `suffix`: the text to fill in between (one text prompt, which may be empty: the gap at the start)."""
        if self.suffix is None:
            return None
        if not isinstance(self.prompt, str):
            raise ApiError(
                400, "suffix: goes with one text prompt (the text before the gap)", "suffix", "invalid_value"
            )
        return Infill(self.prompt, self.suffix)

    def prompts(self) -> tuple[list[str | list[int]], bool]:
        """(the prompts, whether the request is a batch): a text or token list alone, or a list of them.

        Token ids are integers (5.0 counts as 5, as JSON Schema says); an empty text is an empty prompt."""
        p = self.prompt
        if isinstance(p, list) and all(_is_token(t) for t in p):
            return [[int(t) for t in p]], False  # token ids ([] is an empty prompt, refused as one)
        if isinstance(p, str):
            out, batch = [p], False
        elif isinstance(p, list):
            out, batch = self._batch(p), True
        else:
            msg = "must be a string, a list of token ids, or a list of either"
            raise ApiError(400, f"prompt: {msg}", "prompt", "invalid_type")
        for i, item in enumerate(out):
            if item == "":
                where = f"prompt.{i}" if batch else "prompt"
                raise ApiError(400, f"{where}: the prompt is empty", where, "empty_prompt")
        return out, batch

    @staticmethod
    def _batch(p: list) -> list[str | list[int]]:
        if len(p) > MAX_PROMPTS:
            raise ApiError(400, f"prompt: at most {MAX_PROMPTS} prompts, got {len(p)}", "prompt", "invalid_value")
        texts = isinstance(p[0], str)
        out: list[str | list[int]] = []
        for i, item in enumerate(p):
            if texts and not isinstance(item, str):
                raise ApiError(400, f"prompt.{i}: a batch of texts holds texts only", f"prompt.{i}", "invalid_type")
            if not texts:
                if not isinstance(item, list):
                    msg = "a batch of token lists holds token-id lists only"
                    raise ApiError(400, f"prompt.{i}: {msg}", f"prompt.{i}", "invalid_type")
                bad = next((j for j, t in enumerate(item) if not _is_token(t)), None)
                if bad is not None:
                    where = f"prompt.{i}.{bad}"
                    raise ApiError(400, f"{where}: a token id is an integer", where, "invalid_type")
                item = [int(t) for t in item]
            out.append(item)
        return out


def _is_token(value) -> bool:
    """An integer token id: an int, or a float with no fraction (JSON Schema's integer), never a bool."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())

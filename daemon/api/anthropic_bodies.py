"""Anthropic's Messages API's request shapes (POST /v1/messages and /v1/messages/count_tokens), its field
names and defaults."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from minibatch.engine.core.sampling_params import MAX_TOP_K

from ..protocol import Float, Int
from .messages import FUNCTION_NAME, MAX_TOOLS


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    cache_control: dict[str, Any] | None = None  # prompt caching is automatic here (prefix cache)


class TextBlock(_Block):
    type: Literal["text"]
    text: StrictStr
    citations: list[Any] | None = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: StrictStr = Field(min_length=1, max_length=256)
    name: StrictStr = Field(pattern=FUNCTION_NAME)
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: StrictStr = Field(min_length=1, max_length=256)
    content: StrictStr | list[TextBlock] = ""
    is_error: StrictBool | None = None


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: StrictStr


class ImageSource(BaseModel):
    """An image block's source: base64 `data` of a `media_type`; a `url` or a `file_id` source is accepted by
    the schema so the refusal can name it (the daemon fetches nothing and keeps no files)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["base64", "url", "file"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"] | None = None
    data: StrictStr | None = None
    url: StrictStr | None = None
    file_id: StrictStr | None = None


class ImageBlock(_Block):
    type: Literal["image"]
    source: ImageSource


class MediaBlock(BaseModel):
    """Documents: accepted by the schema so the refusal can name the block."""

    model_config = ConfigDict(extra="allow")
    type: Literal["document"]


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock | ImageBlock | MediaBlock,
    Field(discriminator="type"),
]


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["user", "assistant"]
    content: StrictStr | list[Block]


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: StrictStr = Field(pattern=FUNCTION_NAME)
    description: StrictStr | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None


class ThinkingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["enabled", "disabled"]
    budget_tokens: Int | None = Field(default=None, ge=1)


class JsonOutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # accepted: no knob here
    format: JsonOutputFormat | None = None  # the answer follows this JSON schema (structured output)


class CountTokensRequest(BaseModel):
    """POST /v1/messages/count_tokens: what the prompt of a Messages request would be."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: StrictStr
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=1000)
    system: StrictStr | list[TextBlock] | None = None
    tools: list[ToolDef] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: Int = Field(ge=1)  # required, as Anthropic requires it
    stop_sequences: list[StrictStr] | None = Field(default=None, max_length=16)
    temperature: Float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: Int | None = Field(default=None, ge=0, le=MAX_TOP_K)
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    stream: StrictBool = False
    ignore_eos: StrictBool = False  # an extension, as in the chat API: run to max_tokens (benchmarks)
    seed: Int | None = Field(default=None, ge=0, le=2**63 - 1)  # an extension: the same seed, the same tokens

    def sampling(self) -> dict:
        """What the request set, in SamplingParams' names (top_k 0 is unset, as Anthropic means it)."""
        given = {"max_tokens": self.max_tokens, "stop": list(self.stop_sequences or []), "ignore_eos": self.ignore_eos}
        if self.seed is not None:
            given["seed"] = self.seed
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name):
                given[name] = getattr(self, name)
        if self.temperature == 0:
            given["temperature"] = 0.0
        return given


# a SamplingParams field -> Anthropic's name for it, where they differ
NAMES = {"stop": "stop_sequences"}
# Anthropic's defaults for what neither the request nor the model sets
API_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}

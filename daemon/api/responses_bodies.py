"""The Responses API's request shapes (POST /v1/responses), its field names and defaults."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictStr, Tag

from ..generation.reasoning import EFFORTS
from ..protocol import Float, Int
from .messages import FUNCTION_NAME, MAX_TOOLS

# OpenAI's limits on metadata: 16 pairs, keys up to 64 characters, values up to 512
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class InputText(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: StrictStr
    annotations: list[Any] | None = None


class InputImage(_Body):
    type: Literal["input_image"]
    image_url: StrictStr | None = None  # a base64 data: URL, or a file:// URL inside --media-path
    file_id: StrictStr | None = None  # (refused: the daemon keeps no files)
    detail: Literal["auto", "low", "high"] | None = None


Content = Annotated[InputText | InputImage, Field(discriminator="type")]


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: StrictStr | list[Content]
    id: StrictStr | None = None
    status: StrictStr | None = None


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: StrictStr = Field(min_length=1, max_length=256)
    name: StrictStr = Field(pattern=FUNCTION_NAME)
    arguments: StrictStr
    id: StrictStr | None = None
    status: StrictStr | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: StrictStr = Field(min_length=1, max_length=256)
    output: StrictStr
    id: StrictStr | None = None
    status: StrictStr | None = None


class ReasoningItem(BaseModel):
    """An earlier reasoning item sent back: nothing of it reaches the template."""

    model_config = ConfigDict(extra="allow")
    type: Literal["reasoning"]


def _item_kind(value) -> str:
    return value.get("type", "message") if isinstance(value, dict) else "message"


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


class FunctionTool(_Body):
    type: Literal["function"]
    name: StrictStr = Field(pattern=FUNCTION_NAME)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: StrictStr


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


class TextOptions(_Body):
    format: TextFormat | None = None
    verbosity: StrictStr | None = None


class Reasoning(_Body):
    effort: Literal[EFFORTS] | None = None  # a thinking budget (generation/reasoning.py); "none": no thinking
    summary: StrictStr | None = None


class ResponsesRequest(_Body):
    model: StrictStr | None = None
    input: Annotated[
        Annotated[StrictStr, Tag("text")] | Annotated[list[Item], Tag("items")],
        Discriminator(lambda v: "text" if isinstance(v, str) else "items"),
        Field(min_length=1),
    ]
    instructions: StrictStr | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    text: TextOptions | None = None
    max_output_tokens: Int | None = Field(default=None, ge=1)
    temperature: Float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)
    seed: Int | None = Field(default=None, ge=0, le=2**63 - 1)  # an extension: the same seed, the same tokens
    # accepted; the effort is the template's business (ignored here). A thinking model's thoughts come back as
    # a reasoning item before the answer (with --reasoning-format auto)
    reasoning: Reasoning | None = None
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: StrictStr | None = None
    metadata: (
        dict[
            Annotated[StrictStr, Field(max_length=METADATA_KEY)],
            Annotated[StrictStr, Field(max_length=METADATA_VALUE)],
        ]
        | None
    ) = Field(default=None, max_length=METADATA_PAIRS)
    parallel_tool_calls: StrictBool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: StrictStr | None = None

    def sampling(self) -> dict:
        """What the request set, in SamplingParams' names."""
        given = {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_output_tokens}
        given["seed"] = self.seed
        return {k: v for k, v in given.items() if v is not None}


# a SamplingParams field -> the Responses API's name for it, where they differ
NAMES = {"max_tokens": "max_output_tokens"}
# the API's defaults for what neither the request nor the model sets
API_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}

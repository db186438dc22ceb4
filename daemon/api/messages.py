"""Chat messages and tool definitions as requests carry them (OpenAI's shapes, validated with pydantic)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator

from ..generation.images import check_url, image_part


class Body(BaseModel):
    """A request body part: unknown fields refused, types strict."""

    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(Body):
    type: Literal["text"]
    text: StrictStr


class ImageUrl(Body):
    url: StrictStr  # a base64 data: URL, or a file:// URL inside --media-path
    detail: Literal["auto", "low", "high"] | None = None  # (every image is seen at the tower's one size)


class ImageUrlPart(Body):
    type: Literal["image_url"]
    image_url: ImageUrl | StrictStr  # (some clients send the URL alone)

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


ContentPart = Annotated[TextPart | ImageUrlPart, Field(discriminator="type")]

FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names
MAX_TOOLS = 128


class FunctionCall(Body):
    name: StrictStr = Field(pattern=FUNCTION_NAME)
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(Body):
    id: StrictStr = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


_CALLS = {"type": "array", "minItems": 1}
# What _content_where_needed checks, for the document: content unless an assistant message carries calls,
# and calls on assistant messages only.
MESSAGE_RULES = {
    "allOf": [
        {
            "anyOf": [
                {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
                {
                    "required": ["role", "tool_calls"],
                    "properties": {"role": {"const": "assistant"}, "tool_calls": _CALLS},
                },
            ]
        },
        {
            "anyOf": [
                {"not": {"required": ["tool_calls"], "properties": {"tool_calls": _CALLS}}},
                {"required": ["role"], "properties": {"role": {"const": "assistant"}}},
            ]
        },
    ]
}


class Message(Body):
    model_config = ConfigDict(json_schema_extra=MESSAGE_RULES)
    role: Literal["system", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TOOLS)  # an assistant's earlier calls
    tool_call_id: StrictStr | None = None  # which call a tool message answers

    @model_validator(mode="after")
    def _content_where_needed(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(
                f"content is required in a {self.role} message"
                + (" without tool_calls" if self.role == "assistant" else "")
            )
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    def for_template(self, at: str = "messages.0") -> dict:
        """The message as chat templates read it (transformers' convention: call arguments as objects); its
        images as the pipeline's image parts, named by where they are (`at`: the message's own field)."""
        content: str | list[dict] = self.text()
        if isinstance(self.content, list) and any(isinstance(p, ImageUrlPart) for p in self.content):
            content = [
                {"type": "text", "text": p.text}
                if isinstance(p, TextPart)
                else image_part(check_url(p.url, f"{at}.content.{j}.image_url"))
                for j, p in enumerate(self.content)
            ]
        out: dict = {"role": self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text  # not JSON: the template gets it as written


class FunctionDef(Body):
    name: StrictStr = Field(pattern=FUNCTION_NAME)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema for the arguments object
    strict: StrictBool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Body):
    name: StrictStr


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction

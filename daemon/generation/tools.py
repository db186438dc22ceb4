"""Function calling: which tools a request offers, whether the template can show them, and reading calls back
(the grammar that forces a call is in grammars.py).

Calls are read in the Hermes layout that Qwen 2.5/3, Hermes and SmolLM3 templates teach their models:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them, text around them being
the message's content. A template that renders tools in another layout is refused with the reason
(its calls could not be returned as `tool_calls`).
"""

from __future__ import annotations

import json
import uuid

from ..protocol import ApiError

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def check_template(tokenizer) -> None:
    """The model's template must show it the tools and teach it a call layout we can read back."""
    if not tokenizer.supports_tools:
        raise ApiError(
            400,
            "tools: this model's chat template does not render tools, so the model would never see "
            "them; send the request without tools (or use a model whose template supports them)",
            "tools",
            "unsupported",
        )
    if tokenizer.tool_call_format != "hermes":
        raise ApiError(
            400,
            "tools: this model's chat template renders tools, but in a call layout minibatch does not "
            "read back (it reads <tool_call>{...}</tool_call>)",
            "tools",
            "unsupported",
        )


def parse_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) from a model's output; a block that is not a call stays in the content."""
    calls, content, pos = [], [], 0
    while (start := text.find(OPEN, pos)) >= 0:
        end = text.find(CLOSE, start)
        try:
            obj = json.loads(text[start + len(OPEN) : end if end >= 0 else len(text)])
        except ValueError:
            obj = None
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            break
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": obj["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                },
            }
        )
        content.append(text[pos:start])
        pos = len(text) if end < 0 else end + len(CLOSE)
    content.append(text[pos:])
    joined = "".join(content).strip()
    return (joined or None), calls


class CallSplitter:
    """Streams content as it comes and holds back everything from the first <tool_call> to the end."""

    def __init__(self) -> None:
        self.text, self.sent, self.in_call = "", 0, False

    def push(self, delta: str) -> str:
        """The content that can be sent now."""
        self.text += delta
        if self.in_call:
            return ""
        start = self.text.find(OPEN, self.sent)
        if start >= 0:
            self.in_call = True
            upto = start
        else:  # keep back a tail that could be the start of <tool_call>
            upto = len(self.text) - next((k for k in range(len(OPEN) - 1, 0, -1) if self.text.endswith(OPEN[:k])), 0)
        out, self.sent = self.text[self.sent : upto], max(self.sent, upto)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(the content still to send, the calls) at the end of the output."""
        rest = self.text[self.sent :]
        if not self.in_call:
            return rest, []
        content, calls = parse_calls(rest)
        return ((content or "") if calls else rest), calls

"""One output's text in the parts every API answers with: the thoughts (a thinking model's, apart when its
reasoning is split), the answer's text, and the tool calls read from the answer. The four API faces
(the api/ modules: openai.py, ollama.py, anthropic.py, responses.py) shape these parts; none splits text itself.

`split_answer` takes a whole output; `AnswerStream` the same output delta by delta: thoughts as they come,
the answer's text as soon as it cannot be the start of a tool call, the calls whole at the end.
"""

from __future__ import annotations

from typing import NamedTuple

from .reasoning import ReasoningSplitter, Thinking, split_reasoning
from .tools import CallSplitter, parse_calls


class Parts(NamedTuple):
    thought: str  # the reasoning ("" when none, or when it is left in the text)
    text: str | None  # the answer's text; None when the answer is only tool calls and had no text around them
    calls: list[dict]  # the tool calls (OpenAI's shape), only with tools offered


def split_answer(text: str, thinking: Thinking | None, tools: bool) -> Parts:
    thought, answer = split_reasoning(text, *thinking) if thinking else ("", text)
    if not tools:
        return Parts(thought, answer, [])
    content, calls = parse_calls(answer)
    return Parts(thought, content if calls else answer, calls)


class AnswerStream:
    """Splits one streamed output; `push` each delta, with `finished` on the last."""

    def __init__(self, thinking: Thinking | None, tools: bool) -> None:
        self._reasoning = ReasoningSplitter(*thinking) if thinking else None
        self._calls = CallSplitter() if tools else None

    def push(self, delta: str, finished: bool = False) -> Parts:
        """What can be sent now: new thoughts, new answer text ("" when none), and the calls at the end."""
        thought, text = self._reasoning.push(delta) if self._reasoning else ("", delta)
        if finished and self._reasoning:
            more, rest = self._reasoning.finish()
            thought, text = thought + more, text + rest
        calls: list[dict] = []
        if self._calls is not None:
            text = self._calls.push(text)
            if finished:
                rest, calls = self._calls.finish()
                text += rest
        return Parts(thought, text, calls)

    @property
    def thought(self) -> str:
        """Every thought pushed so far."""
        return self._reasoning.text if self._reasoning else ""

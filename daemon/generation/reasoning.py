"""A thinking model's reasoning, split from its answer: `<think>…</think>` (tokenizer.reasoning_tags says
which models think) goes to `reasoning_content` / Ollama's `thinking` / Anthropic's thinking blocks, the
rest is the answer that tool calls and JSON are read from. `--reasoning-format none` (or a request's
`reasoning_format: "none"`) leaves everything in the content, as the model wrote it."""

from __future__ import annotations

from typing import NamedTuple

from minibatch.engine.core.sampling_params import GrammarState
from minibatch.engine.text.thinking import ThinkingGate

from ..protocol import ApiError

REASONING_FORMATS = ("auto", "none")
# The reasoning levels the APIs name (OpenAI's reasoning_effort and Responses' reasoning.effort, Ollama's think
# levels), as thinking-token budgets: past one the end-of-thinking marker is put in and the answer begins. "none"
# turns the thinking off (the template's switch where it has one, else a budget of 0); "high" has no bound but
# the daemon's --reasoning-budget. A template that reads `reasoning_effort` (gpt-oss) is handed the level too.
EFFORT_BUDGETS: dict[str, int | None] = {"none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": None}
EFFORTS = tuple(EFFORT_BUDGETS)


def reasoning_format(requested: str | None, default: str) -> str:
    value = requested or default
    if value not in REASONING_FORMATS:
        raise ApiError(
            400, f"reasoning_format: must be one of {', '.join(REASONING_FORMATS)}, got {value!r}", "reasoning_format"
        )
    return value


class Thinking(NamedTuple):
    """How a request's output thinks: the model's (open, close) tags, and whether the prompt opened them."""

    tags: tuple[str, str]
    inside: bool


def gate(model, grammar: GrammarState | None, thinking: Thinking | None, budget: int | None) -> GrammarState | None:
    """The grammar the sampler sees. With the reasoning apart, the answer's grammar starts after the thinking
    and `budget` (thinking tokens at most, None: no bound) closes it; with it left in the content (or a model
    that does not think) the grammar constrains the whole output, as before."""
    if thinking is None or (grammar is None and budget is None):
        return grammar
    vocab = model.tokenizer.vocab()
    open_id, close_id = (vocab[tag] for tag in thinking.tags)
    return ThinkingGate(grammar, open_id, close_id, list(model.info.eos_token_ids), thinking.inside, budget)


class ReasoningSplitter:
    """Streams (reasoning, answer) pieces from output deltas; a tag cut across deltas is held back until
    it is whole. `inside`: the output starts in the thinking (the prompt opened it)."""

    def __init__(self, tags: tuple[str, str], inside: bool = False) -> None:
        self.open, self.close = tags
        self.inside = inside
        self.started = inside  # the thinking began (the open tag seen, or opened by the prompt)
        self.done = False  # the close tag seen: the rest is the answer
        self._held = ""
        self._trim = inside  # drop the newlines that follow a tag
        self.reasoning: list[str] = []

    def push(self, delta: str) -> tuple[str, str]:
        text, thought, answer = self._held + delta, [], []
        self._held = ""
        while text:
            if self._trim:  # the newlines right after a tag belong to neither part
                text = text.lstrip("\n")
                if not text:
                    break
                self._trim = False
            if self.done:
                answer.append(text)
                break
            if not self.inside:
                stripped = text.lstrip()
                if not self.started and stripped.startswith(self.open):
                    self.inside = self.started = self._trim = True
                    text = stripped[len(self.open) :]
                    continue
                if not self.started and self.open.startswith(stripped) and stripped:
                    self._held = text  # maybe the start of the open tag
                    break
                self.done = True  # the answer starts without thinking
                continue
            end = text.find(self.close)
            if end >= 0:
                thought.append(text[:end])
                self.inside, self.done, self._trim = False, True, True
                text = text[end + len(self.close) :]
                continue
            keep = next((k for k in range(len(self.close) - 1, 0, -1) if text.endswith(self.close[:k])), 0)
            thought.append(text[: len(text) - keep])
            self._held = text[len(text) - keep :]
            break
        out = "".join(thought)
        self.reasoning.append(out)
        return out, "".join(answer)

    def finish(self) -> tuple[str, str]:
        """What is held back at the end: unfinished thinking stays thinking, an unfinished tag is text."""
        held, self._held = self._held, ""
        if not held:
            return "", ""
        if self.inside:
            self.reasoning.append(held)
            return held, ""
        return "", held

    @property
    def text(self) -> str:
        return "".join(self.reasoning)


def split_reasoning(text: str, tags: tuple[str, str], inside: bool = False) -> tuple[str, str]:
    """(reasoning, answer) of a whole output."""
    s = ReasoningSplitter(tags, inside)
    r1, a1 = s.push(text)
    r2, a2 = s.finish()
    return r1 + r2, a1 + a2

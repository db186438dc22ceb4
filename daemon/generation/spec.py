"""A request for generated text (or embeddings, or scores), in no API's terms: what each face's parser
makes of its body (`Generation`, with its `Reasoning` and `Constraint`) and the pipeline runs
(pipeline.py), and which requests a model can serve at all (`check_task`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minibatch.engine.core.sampling_params import (
    DEFAULT_MAX_TOKENS,
    SAMPLING_DEFAULT_FIELDS,
    InvalidParameterError,
    SamplingParams,
)
from minibatch.engine.lora.names import LoraUses
from minibatch.engine.text.fim import Infill

from ..models.loaded import LoadedModel
from ..protocol import ApiError
from .images import ImageInput
from .loras import LoraScale
from .reasoning import EFFORT_BUDGETS


@dataclass(slots=True)
class Reasoning:
    """How a thinking model's reasoning is asked for. `off`: the template's switch turns the thinking off
    where it has one (enable_thinking); `apart`: the thoughts come back apart from the answer (True), left in
    it (False), or as the daemon's --reasoning-format says (None); `budget`: thinking tokens at most (None: the
    daemon's --reasoning-budget); `effort`: the level asked for (reasoning.py's EFFORT_BUDGETS), handed to a
    template that reads `reasoning_effort`; `template_args`: the client's own switches for the template
    (chat_template_kwargs)."""

    off: bool = False
    apart: bool | None = None
    budget: int | None = None
    effort: str | None = None
    template_args: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def asked(
        cls,
        effort: str | None = None,
        budget: int | None = None,
        apart: bool | None = None,
        template_args: dict[str, Any] | None = None,
        field_name: str = "chat_template_kwargs",
    ) -> Reasoning:
        """A request's reasoning from what its API names: a level (EFFORT_BUDGETS: its budget unless one is
        given; "none" off), a budget, where the thoughts go, the template's switches (enable_thinking false is
        off too). A switch the template is already handed (messages, tools, a special token) is a 400 naming
        it."""
        args = dict(template_args or {})
        for key, value in args.items():
            if key in RESERVED_TEMPLATE_ARGS:
                msg = f"{field_name}.{key}: the template is handed {key} by the daemon; it cannot be set here"
                raise ApiError(400, msg, f"{field_name}.{key}", "invalid_value")
            if key == "enable_thinking" and not isinstance(value, bool):
                msg = f"{field_name}.enable_thinking: must be true or false, got {value!r}"
                raise ApiError(400, msg, f"{field_name}.enable_thinking", "invalid_type")
        off = effort == "none" or args.get("enable_thinking") is False
        if budget is None and effort is not None:
            budget = EFFORT_BUDGETS[effort]
        return cls(off=off, apart=apart, budget=budget, effort=effort, template_args=args)


# What render_chat hands every template itself (tokenizer.render_chat and transformers' apply_chat_template)
RESERVED_TEMPLATE_ARGS = frozenset(
    ("messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token", "unk_token", "sep_token")
    + ("pad_token", "cls_token", "mask_token", "tokenize", "return_dict", "continue_final_message")
)


@dataclass(slots=True)
class Constraint:
    """What the answer must follow: a format (`fmt`: "json" or a JSON schema), a grammar the client wrote
    (`grammar`: GBNF or Lark), or a required tool call (`call`: the functions and the one named, or None for
    any). `param`: the field the client wrote it in."""

    param: str
    fmt: Any = None
    grammar: str | None = None
    call: tuple[list[dict], str | None] | None = None


@dataclass(slots=True)
class Generation:
    """One request for generated text, in no API's terms: each face's parser makes one."""

    request_id: str
    model: str | None  # the model's name; None: the daemon's own
    prompt_field: str  # the field a refused prompt is named by in the client's terms (messages, input, prompt)
    messages: list[dict] | None = None  # the conversation, rendered by the model's chat template
    fill: Infill | None = None  # or code to fill in the middle of, in the model's own markers (engine/text/fim.py)
    fill_field: str = "suffix"  # the field a model without markers is named by (suffix, input_suffix)
    fill_prefix_field: str = "prompt"  # the field of the code before the cursor (prompt, input_prefix)
    prompts: list[str | list[int]] | None = None  # or prompts as they are: texts (encoded) or token ids
    batch: bool = False  # several prompts in one request: a refusal names prompt.N
    # llama-server's images of one text prompt: each MEDIA_MARKER in the text is where one goes
    prompt_images: list[ImageInput] | None = None
    tools: list[dict] | None = None  # OpenAI-shaped tool specs the template sees
    reasoning: Reasoning = field(default_factory=Reasoning)
    sampling: dict[str, Any] = field(default_factory=dict)  # what the client set, in SamplingParams' names
    api_defaults: dict[str, Any] = field(default_factory=dict)  # the API's own defaults for what it left out
    names: dict[str, str] = field(default_factory=dict)  # a SamplingParams field -> the client's name for it
    n: int = 1  # completions per prompt; the prompt is computed once
    constraint: Constraint | None = None
    keep_alive: Any = None  # the request's, as parse_keep_alive reads it; None: the model's own
    operator: bool = False  # the daemon's own user asks (state.is_operator): keep_alive may change a preloaded model's
    stream_interval: float = 0.0  # seconds between a stream's outputs (0: one per engine step)
    cache_salt: int = 0  # the prefix caches' namespace of whoever sent it (set by generate: state.cache_salt)
    lora: list[LoraScale] | None = None  # llama-server's `lora`: adapters by id with their scales, as given
    adapter: str | None = None  # the LoRA adapter `model` names, run over its base model (set by generate)
    loras: LoraUses = ()  # the adapters it runs under with their scales (set by generate: api/lora.py)
    # Embeddings: each prompt computed and pooled (the model's pooling) instead of continued; no text comes
    # back, RequestOutput.embedding does. `truncate`: a prompt past the context keeps its first tokens that fit.
    embed: bool = False
    truncate: bool = False
    dimensions: int | None = None  # an embedding's first this-many values, normalised again (Matryoshka models)
    # Reranking: (query, document) pairs, each one input of a cross-encoder (with `embed`: scored, not continued)
    pairs: list[tuple[str, str]] | None = None

    @property
    def task(self) -> str:
        """What it asks of the model, in EngineInfo.tasks' names."""
        return "rerank" if self.pairs is not None else "embed" if self.embed else "generate"

    def sampling_params(self, max_model_len: int, prompt_len: int, model_defaults: dict) -> SamplingParams:
        """The request's sampling: what it set, else the model's default (generation_config), else the
        API's; without max_tokens, what fits the context (at least 1, so a full prompt is refused as long)."""
        values = dict(self.api_defaults)
        values |= {k: v for k, v in model_defaults.items() if k in SAMPLING_DEFAULT_FIELDS}
        values |= self.sampling
        if values.get("max_tokens") is None:
            fits = max_model_len - prompt_len if max_model_len else DEFAULT_MAX_TOKENS
            values["max_tokens"] = max(1, min(DEFAULT_MAX_TOKENS, fits))
        try:
            return SamplingParams(**values)
        except InvalidParameterError as exc:
            name = self.names.get(exc.field, exc.field)
            message = str(exc).removeprefix(f"{exc.field}: ")
            raise ApiError(400, f"{name}: {message}", name, "invalid_value") from None


# What each task is called in a refusal, and where a client asks for it.
_TASKS = {
    "generate": ("generate text", "/v1/chat/completions"),
    "embed": ("embed", "/v1/embeddings"),
    "rerank": ("rerank", "/v1/rerank"),
}


def check_task(model: LoadedModel, gen: Generation) -> None:
    """A request the model cannot serve (a chat to an encoder, an embedding of a reranker, a rerank of a model
    without a classification head) is a 400 naming the model and what it does."""
    tasks = model.info.tasks
    if gen.task in tasks:
        return
    does = " and ".join(f"{_TASKS[t][0]} ({_TASKS[t][1]})" for t in tasks)
    msg = f"model {model.name} cannot {_TASKS[gen.task][0]}: it can {does}"
    raise ApiError(400, msg, "model", "model_not_supported")

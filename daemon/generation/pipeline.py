"""The one generation pipeline under every API face.

A face (OpenAI's chat and completions, Ollama's, Anthropic's Messages, OpenAI's Responses) parses its body
into a `Generation`, a description in no API's terms, and encodes what `generate` gives back into its own
wire shape. Everything between is here, once: lease the model, render the conversation with its template
(or encode the prompts), decide how a thinking model's reasoning is split, merge the request's sampling
over the model's defaults over the API's, check the tools' schemas and compile the answer's grammar once,
submit one `Request` per completion (all or none), stream, close (which aborts whatever is unfinished, at
any point, before the first output too) and time out with one error. Every refusal on the way is an
ApiError naming the field as the face's client wrote it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from minibatch.engine.core.admission import QueueFull, RequestRejected
from minibatch.engine.core.outputs import RequestOutput
from minibatch.engine.core.request import ImageSpan
from minibatch.engine.core.sampling_params import (
    DEFAULT_MAX_TOKENS,
    SAMPLING_DEFAULT_FIELDS,
    InvalidParameterError,
    SamplingParams,
)
from minibatch.engine.lora.names import LoraUses
from minibatch.engine.text.fim import Infill, assemble, head_bytes
from minibatch.engine.vision.preprocess import Grid

from ..models.loaded import LoadedModel
from ..protocol import ApiError
from ..state import DaemonState, off_loop, timed_out
from .answer import AnswerStream, Parts, split_answer
from .grammars import check_tool_schemas, response_grammar, text_grammar, tool_call_grammar
from .images import MEDIA_MARKER, ImageInput, check_images, encode_images, flatten, grids, images_of, read_images
from .images import for_template as images_for_template
from .images import spans as image_spans
from .loras import LoraScale, request_loras
from .reasoning import EFFORT_BUDGETS, Thinking, gate
from .tools import check_template


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


@dataclass(slots=True)
class Choice:
    """One completion, whole: its outputs' text and tokens, the last output, and its parts."""

    text: str
    token_ids: list[int]
    logprobs: list | None  # per token (log-probability, top alternatives), when asked for
    last: RequestOutput
    parts: Parts


class Running:
    """A generation under way: its completions' streams, read whole (`whole`) or delta by delta (`deltas`)
    inside `limit()`, which ends it with the one timeout error at the request's deadline."""

    def __init__(
        self,
        model: LoadedModel,
        gen: Generation,
        prompts: list[list[int]],
        thinking: Thinking | None,
        arrival: float,
        deadline: float,
        expired: ApiError,
    ) -> None:
        self.model, self.gen, self.prompts, self.thinking = model, gen, prompts, thinking
        self.deadline, self.expired = deadline, expired  # when, and the one error it ends with then
        self.arrival = arrival  # when it came (the deadline is --request-timeout past it)
        self.tools = gen.tools is not None
        self.streams: list = []  # one RequestStream per completion
        self.ids: list[str] = []  # their engine request ids
        self.answers: list[AnswerStream] = []  # deltas(): each completion's split so far
        self.ended: set[int] = set()  # completions whose final output was read (and counted)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def name(self) -> str:
        """The model its answer names: the adapter asked for, else the model's name."""
        return self.gen.adapter or self.model.name

    def deadline_now(self) -> float:
        """The request's deadline as of now: --request-timeout from its arrival or from the last chunk of any of
        its prompts computed, whichever is later (a long prompt being computed is never cut for its length)."""
        engine, timeout = self.model.engine, self.deadline - self.arrival
        progress = [t for t in map(engine.prompt_progress, self.ids) if t is not None]
        return max([self.deadline, *(t + timeout for t in progress)])

    @contextlib.asynccontextmanager
    async def limit(self) -> AsyncIterator[None]:
        """The request's time limit (deadline_now): past it, the one timeout error. Checked when the deadline
        comes, and moved on as long as a prompt makes progress."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(None) as timer:

                def check() -> None:
                    nonlocal handle
                    when = self.deadline_now()
                    if when > loop.time():
                        handle = loop.call_at(when, check)
                    else:
                        timer.reschedule(loop.time())

                handle = loop.call_at(self.deadline, check)
                try:
                    yield
                finally:
                    handle.cancel()
        except TimeoutError:
            raise self.expired from None

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) from every completion as they come; each final output is counted by the
        model's monitor. Leaving early closes (and so aborts) them all."""
        done = self.model.monitor.on_request_done
        async for i, out in _merged(self.streams):
            if out.finished or out.error:
                self.ended.add(i)
                done(out.metrics, None if out.error else out.finish_reason, tuple(n for n, _ in self.gen.loras))
            yield i, out

    async def deltas(self) -> AsyncIterator[tuple[int, RequestOutput, Parts]]:
        """(choice, output, what of it can be sent now): the thoughts apart, a tool call held back and given
        whole at the end (answer.AnswerStream)."""
        self.answers = answers = [AnswerStream(self.thinking, self.tools) for _ in self.streams]
        async for i, out in self.outputs():
            yield i, out, answers[i].push(out.text, out.finished) if not out.error else Parts("", "", [])

    async def whole(self) -> list[Choice]:
        """Every completion to its end (within the time limit); an engine error is a 500."""
        n = len(self.streams)
        text, tokens, lps, last = [[] for _ in range(n)], [[] for _ in range(n)], [None] * n, [None] * n
        async with self.limit():
            async for i, out in self.outputs():
                text[i].append(out.text)
                tokens[i] += out.token_ids
                if out.logprobs is not None:
                    lps[i] = (lps[i] or []) + out.logprobs
                last[i] = out
        failed = next((out for out in last if out.error), None)
        if failed is not None:
            raise ApiError(500, failed.error, None, "engine_error", "server_error")
        return [
            Choice("".join(t), ids, lp, out, split_answer("".join(t), self.thinking, self.tools))
            for t, ids, lp, out in zip(text, tokens, lps, last)
        ]

    async def close(self) -> None:
        """Abort what is unfinished (its client gone, a stop, an error elsewhere), counted as aborted."""
        for i, stream in enumerate(self.streams):
            if i not in self.ended:
                self.ended.add(i)
                self.model.monitor.on_request_done(None, "abort")
            await stream.aclose()


@contextlib.asynccontextmanager
async def generate(state: DaemonState, gen: Generation, request: web.Request) -> AsyncIterator[Running]:
    """Lease the model, render, admit and submit `gen` (sent by `request`'s client: its prefix caches'
    namespace); the Running it yields is closed on the way out (aborting what is unfinished, whatever the
    reason: done, an error, the client gone)."""
    gen.cache_salt = state.cache_salt(request)
    deadline = asyncio.get_running_loop().time() + state.request_timeout
    keep = state.keep_alive_of(gen.keep_alive, gen.operator)
    base, gen.adapter = state.check_serving().adapter_route(gen.model)
    async with state.lease(base, keep) as model, contextlib.AsyncExitStack() as adapters:
        gen.loras = request_loras(model, gen.adapter, gen.lora)
        try:
            async with asyncio.timeout_at(deadline):
                # its adapters resident and held to its end (models/adapters.py)
                await adapters.enter_async_context(model.adapters.held(n for n, _ in gen.loras))
                running = await _start(state, model, gen, deadline)
        except TimeoutError:
            raise timed_out(state) from None
        if keep is not None:
            keep.taken = True  # admitted: its keep_alive applies (a refusal above changed nothing)
        try:
            yield running
        finally:
            await running.close()


@dataclass(slots=True)
class Rendered:
    """A generation's prompts as token ids; how the output's reasoning is split; the chat prompt's images
    (their placeholder runs and embeddings, in order)."""

    prompts: list[list[int]]
    thinking: Thinking | None = None
    images: tuple[ImageSpan, ...] = ()


async def render(state: DaemonState, model: LoadedModel, gen: Generation, encode: bool = True) -> Rendered:
    """The prompts' token ids (the conversation by the template, or the prompts encoded), how the output's
    reasoning is split and the conversation's images, off the event loop. `encode`: run the images through
    the tower (a count of tokens needs only their places)."""
    tok = model.tokenizer
    limit = model.info.max_model_len
    if gen.fill is not None:
        return Rendered([await off_loop(lambda: _fill_ids(model, gen))])
    if gen.pairs is not None:
        return Rendered(await off_loop(lambda: _pair_ids(model, gen)))
    if gen.tools is not None:
        check_template(tok)
    if gen.prompt_images is not None:
        return await _prompt_with_images(state, model, gen, encode)
    if gen.messages is None:
        texts = list(gen.prompts or [])
        for i, p in enumerate(texts):
            if isinstance(p, str):
                if gen.truncate:
                    texts[i] = _head(tok, p, limit)
                else:
                    _check_fits(tok, p, limit, f"{gen.prompt_field}.{i}" if gen.batch else gen.prompt_field)
        return Rendered(await off_loop(lambda: [p if isinstance(p, list) else tok.encode_prompt(p) for p in texts]))
    ask = gen.reasoning
    args = dict(ask.template_args)
    if tok.reasoning_tags is not None and ask.off and tok.can_stop_thinking:
        args["enable_thinking"] = False
    if ask.effort is not None and "reasoning_effort" in (tok.chat_template or ""):  # gpt-oss's levels
        args.setdefault("reasoning_effort", ask.effort)
    apart = ask.apart if ask.apart is not None else state.reasoning_format == "auto"
    split = tok.reasoning_tags is not None and apart and args.get("enable_thinking") is not False
    inputs = images_of(gen.messages)
    encoder = model.engine.engine.images
    check_images(model.name, encoder, inputs)
    messages = gen.messages
    if encoder is not None:
        lists = "image" in (tok.chat_template or "")  # a template that writes content parts' images (Gemma 3's)
        messages = images_for_template(messages, encoder.layout, lists)
    elif not inputs:
        messages = flatten(messages)
    data, cuts = await _read(state, encoder, inputs)

    def run() -> tuple[list[int], list[list[int]], Thinking | None]:
        text = tok.render_chat(messages, tools=gen.tools, **args)
        _check_fits(tok, text, limit, gen.prompt_field)
        ids, offsets = encoder.layout.prompt(text, tok.encode, cuts) if encoder is not None else (tok.encode(text), [])
        inside = tok.thinks_from_prompt(messages, tools=gen.tools, **args) if split else False
        return ids, offsets, (Thinking(tok.reasoning_tags, inside) if split else None)

    try:
        ids, offsets, thinking = await off_loop(run)
    except ValueError as exc:
        raise ApiError(400, str(exc), gen.prompt_field, "no_chat_template") from None
    if len(offsets) != len(inputs):
        msg = f"the chat template put {len(offsets)} images in the prompt where the request sends {len(inputs)}"
        raise ApiError(400, f"{gen.prompt_field}: {msg}", gen.prompt_field, "invalid_image")
    if not inputs or not encode:
        return Rendered([ids], thinking)
    assert encoder is not None
    encoded = await _encoded(model, encoder, inputs, data)
    return Rendered([ids], thinking, image_spans(encoder, offsets, encoded))


async def _prompt_with_images(state: DaemonState, model: LoadedModel, gen: Generation, encode: bool) -> Rendered:
    """A raw prompt with its images where its MEDIA_MARKERs are (llama-server's multimodal_data)."""
    tok, inputs, encoder = model.tokenizer, gen.prompt_images or [], model.engine.engine.images
    check_images(model.name, encoder, inputs)
    assert encoder is not None
    (text,) = gen.prompts or [""]
    if text.count(MEDIA_MARKER) != len(inputs):
        msg = f"the prompt has {text.count(MEDIA_MARKER)} {MEDIA_MARKER} markers for {len(inputs)} images"
        raise ApiError(400, f"{gen.prompt_field}: {msg}", gen.prompt_field, "invalid_image")
    _check_fits(tok, text, model.info.max_model_len, gen.prompt_field)
    data, cuts = await _read(state, encoder, inputs)

    def run() -> tuple[list[int], list[list[int]]]:
        ids, offsets = encoder.layout.prompt(text, tok.encode, cuts, MEDIA_MARKER)
        bos = tok.added_bos
        if bos is not None and (not ids or ids[0] != bos):
            ids, offsets = [bos, *ids], [[o + 1 for o in runs] for runs in offsets]
        return ids, offsets

    ids, offsets = await off_loop(run)
    if not encode:
        return Rendered([ids])
    encoded = await _encoded(model, encoder, inputs, data)
    return Rendered([ids], None, image_spans(encoder, offsets, encoded))


async def _read(state: DaemonState, encoder, inputs: list[ImageInput]) -> tuple[list[bytes], list[Grid]]:
    """The images' bytes and how the processor cuts each (from its header: the prompt's layout of it), off the
    event loop."""
    if not inputs:
        return [], []

    def read() -> tuple[list[bytes], list[Grid]]:
        data = read_images(encoder, inputs, state.media_path)
        return data, grids(encoder, inputs, data)

    return await off_loop(read)


async def _encoded(model: LoadedModel, encoder, inputs: list[ImageInput], data: list[bytes]):
    """The images through the tower on its own thread (an image waiting for it holds no thread other work
    needs); the engine's events say when they go in and come out (the chat's panel counts them)."""
    encoder.queued += len(inputs)
    model.monitor.changed()
    try:
        return await encode_images(encoder, inputs, data)
    finally:
        encoder.queued -= len(inputs)
        model.monitor.changed()


def _check_fits(tok, text: str, limit: int | None, field: str, what: str = "the prompt") -> None:
    """Refuse a text that cannot fit the context whatever it encodes to, before encoding it: the tokenizer
    holds the interpreter for as long as it encodes, which every other client (/health, other streams) waits
    out. A text within the bound is encoded and admission checks its exact length."""
    if not limit or len(text) * 4 <= limit * tok.max_token_bytes:  # (no need to count its bytes)
        return
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limit * tok.max_token_bytes:
        least = -(-size // tok.max_token_bytes)
        raise ApiError(
            400,
            f"{field}: {what} is {size} bytes, at least {least} tokens; the context limit is {limit}",
            field,
            "context_length_exceeded",
        )


def _fill_ids(model: LoadedModel, gen: Generation) -> list[int]:
    """The fill-in-the-middle prompt in the model's markers, within its context; a 400 naming the field when
    the model has none (a chat model)."""
    tok = model.tokenizer
    if tok.fim is None:
        msg = f"model {model.name} has no fill-in-the-middle tokens: it cannot fill in between a prefix and a suffix"
        raise ApiError(400, f"{gen.fill_field}: {msg}", gen.fill_field, "fim_unsupported")
    limit, fill = model.info.max_model_len, gen.fill
    texts = [(fill.prefix, gen.fill_prefix_field), (fill.suffix, gen.fill_field), (fill.prompt, "prompt")]
    texts += [(text, f"input_extra.{i}.text") for i, (_, text) in enumerate(fill.extra)]
    for text, name in texts:  # (each is cut to the window before it is encoded: fim.cut_for)
        _check_fits(tok, text, limit, name, "the text")
    want = gen.sampling.get("max_tokens") or 0
    return assemble(
        tok.fim, tok.encode, fill, limit, min(want, limit // 4), tok.added_bos, max_token_bytes=tok.max_token_bytes
    )


def _pair_ids(model: LoadedModel, gen: Generation) -> list[list[int]]:
    """Each (query, document) pair as one input; a text that cannot fit is refused before it is encoded
    (a document is cut instead where the request truncates)."""
    tok, limit = model.tokenizer, model.info.max_model_len
    pairs = list(gen.pairs or [])
    for i, (query, doc) in enumerate(pairs):
        if i == 0:
            _check_fits(tok, query, limit, "query", "the query")
        if gen.truncate:
            pairs[i] = (query, _head(tok, doc, limit))
        else:
            _check_fits(tok, doc, limit, f"{gen.prompt_field}.{i}", "the document")
    return [tok.encode_pair(query, doc) for query, doc in pairs]


def _head(tok, text: str, limit: int | None) -> str:
    """A text to be cut to the context after encoding, cut before it where it is far longer: its first
    (limit + 64) x max_token_bytes bytes hold more than `limit` tokens, whose first ones are the whole text's."""
    if not limit:
        return text
    return head_bytes(text, (limit + 64) * tok.max_token_bytes)


async def _grammar(model: LoadedModel, gen: Generation):
    """The answer's grammar, compiled once (each completion walks its own copy); tools' schemas checked."""
    if gen.tools is not None:
        await check_tool_schemas(model, gen.tools)
    c = gen.constraint
    if c is None:
        return None
    if c.call is not None:
        return await tool_call_grammar(model, *c.call)
    if c.grammar is not None:
        return await text_grammar(model, c.grammar, c.param)
    return await response_grammar(model, c.fmt, c.param)


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


async def _start(state: DaemonState, model: LoadedModel, gen: Generation, deadline: float) -> Running:
    check_task(model, gen)
    engine = model.ready_engine()
    rendered = await render(state, model, gen)
    prompts, thinking = rendered.prompts, rendered.thinking
    if gen.embed:
        return _submit_embeddings(model, gen, prompts, deadline - state.request_timeout, deadline, timed_out(state))
    grammar = await _grammar(model, gen)
    running = Running(model, gen, prompts, thinking, deadline - state.request_timeout, deadline, timed_out(state))
    total = len(prompts) * gen.n
    budget = gen.reasoning.budget if gen.reasoning.budget is not None else state.reasoning_budget
    ids = [gen.request_id] if total == 1 else [f"{gen.request_id}-{k}" for k in range(total)]
    limit = model.info.max_model_len
    for k, rid in enumerate(ids):
        p, i = divmod(k, gen.n)
        try:
            params = gen.sampling_params(limit, len(prompts[p]), model.info.generation_defaults)
            if gen.fill is not None:  # the middle ends at the model's own end markers too
                params.stop_token_ids = [*params.stop_token_ids, *model.tokenizer.fim.stops]
            params.grammar = gate(model, grammar if k == 0 or grammar is None else grammar.copy(), thinking, budget)
            if i and params.seed is not None:  # the n completions of one prompt draw differently, reproducibly
                params.seed = (params.seed + i) % 2**63
            share, batch = ids[k - i] if i else None, p if gen.batch else None
            _submit(engine, gen, prompts[p], params, rid, share, batch, images=rendered.images)
        except BaseException:
            await running.close()  # all or none
            raise
        running.ids.append(rid)
        running.streams.append(engine.stream(rid, gen.stream_interval))
    return running


def _submit_embeddings(
    model: LoadedModel, gen: Generation, prompts: list[list[int]], arrival: float, deadline: float, expired: ApiError
) -> Running:
    """One prefill-only request per input, pooled as the model pools (each ends with its prompt: it holds KV
    blocks only while its prompt is computed), all or none."""
    engine, limit, size = model.ready_engine(), model.info.max_model_len, model.info.embedding_size
    if gen.dimensions is not None and gen.dimensions > size:
        msg = f"this model's embeddings have {size} dimensions; at most that many can be kept, got {gen.dimensions}"
        raise ApiError(400, f"dimensions: {msg}", "dimensions", "invalid_value")
    if gen.truncate and limit:
        # one position is admission's (it reserves a next token); an encoder's input keeps its closing separator
        keep = 1 if "generate" not in model.info.tasks else 0
        prompts = [p if len(p) < limit else p[: limit - 1 - keep] + p[len(p) - keep :] for p in prompts]
    running = Running(model, gen, prompts, None, arrival, deadline, expired)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    ids = [gen.request_id] if len(prompts) == 1 else [f"{gen.request_id}-{k}" for k in range(len(prompts))]
    try:
        for k, (rid, prompt) in enumerate(zip(ids, prompts)):
            _submit(engine, gen, prompt, params, rid, None, k if gen.batch else None, model.info.pooling)
            running.ids.append(rid)
            running.streams.append(engine.stream(rid))
    except BaseException:
        for rid in running.ids:
            engine.abort(rid)
        raise
    return running


def _submit(
    engine,
    gen: Generation,
    ids: list[int],
    params,
    rid: str,
    share: str | None,
    prompt: int | None,
    pooling: str | None = None,
    images: tuple[ImageSpan, ...] = (),
) -> None:
    """Submit one completion; a refusal becomes the API's error, naming the field and, in a batch of prompts,
    the prompt: `prompt.1`, `prompt.0.3` (its token 3)."""
    try:
        # a middle to fill may start from the last one's K/V at shifted positions (engine/core/kv_reuse.py)
        reuse = gen.fill is not None
        engine.submit(
            ids,
            params,
            rid,
            share,
            pooling=pooling,
            cache_salt=gen.cache_salt,
            reuse_shifted=reuse,
            loras=gen.loras,
            images=images,
        )
    except QueueFull as exc:
        raise ApiError(exc.status, str(exc), exc.field, exc.code, "rate_limit_error", {"Retry-After": "1"}) from None
    except RequestRejected as exc:
        param, message, field = exc.field, str(exc), gen.prompt_field
        if param is not None and param.split(".")[0] == "prompt":
            if prompt is not None:
                param = f"{field}.{prompt}{param[len('prompt') :]}"
                message = f"{param}: {message}" if "." in param else message
            elif field != "prompt":
                param = field  # what the API turns into the prompt
                message = f"{field}: {message}"
            elif "." in param:
                message = f"{param}: {message}"
        elif prompt is not None:
            message = f"{field}.{prompt}: {message}"
        elif param is not None:
            param = gen.names.get(param, param)
            message = exc.said_as(param)
        raise ApiError(exc.status, message, param, exc.code) from None


async def _merged(streams: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from n streams as they come; leaving early closes (and so aborts) them all."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        finally:
            await stream.aclose()

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        done = 0
        while done < len(streams):
            i, out = await queue.get()
            done += out.finished
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

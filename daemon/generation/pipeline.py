"""The one generation pipeline under every API face.

A face (OpenAI's chat and completions, Ollama's, Anthropic's Messages, OpenAI's Responses) parses its body
into a `Generation` (spec.py: a description in no API's terms), and encodes what `generate` gives back into
its own wire shape. Everything between is here, once: lease the model, render the conversation with its
template or encode the prompts (prompt.py: also how a thinking model's reasoning is split), merge the
request's sampling over the model's defaults over the API's, check the tools' schemas and compile the
answer's grammar once, submit one `Request` per completion (all or none), stream, close (which aborts
whatever is unfinished, at any point, before the first output too) and time out with one error. Every
refusal on the way is an ApiError naming the field as the face's client wrote it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from minibatch.engine.core.admission import QueueFull, RequestRejected
from minibatch.engine.core.outputs import RequestOutput
from minibatch.engine.core.request import ImageSpan
from minibatch.engine.core.sampling_params import SamplingParams

from ..models.loaded import LoadedModel
from ..protocol import ApiError
from ..state import DaemonState, timed_out
from .answer import AnswerStream, Parts, split_answer
from .grammars import check_tool_schemas, response_grammar, text_grammar, tool_call_grammar
from .loras import request_loras
from .prompt import render
from .reasoning import Thinking, gate
from .spec import Generation, check_task


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

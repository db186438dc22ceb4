"""OpenAI-shaped responses: a whole answer as JSON, or a stream of SSE chunks ending in [DONE]."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from aiohttp import web

from minibatch.engine.core.request import RequestMetrics

from .answer import AnswerStream, split_answer
from .protocol import ApiError
from .state import timed_out


def timings(m: RequestMetrics | None) -> dict:
    def ms(v):
        return None if v is None else round(v * 1000, 3)

    if m is None:
        return {}
    return {
        "queue_wait_ms": ms(m.queue_wait),
        "ttft_ms": ms(m.ttft),
        "decode_ms": ms(m.decode_time),
        "tpot_ms": ms(m.tpot),
        "e2e_ms": ms(m.e2e),
        "preemptions": m.preemptions,
        "cached_prompt_tokens": m.cached_prompt_tokens,
        "draft_tokens": m.draft_tokens,
        "accepted_tokens": m.accepted_tokens,
    }


def usage(m: RequestMetrics | None, prompt_tokens: int, completion_tokens: int, reasoning_tokens: int = 0) -> dict:
    cached = m.cached_prompt_tokens if m else 0
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
    }


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer, token_ids: list[int], entries: list) -> list[dict]:
    """`choices[].logprobs.content` items: each token, its log-probability, its bytes, and the top alternatives."""

    def item(tid: int, lp: float) -> dict:
        text = token_text(tokenizer, tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return [
        {**item(tid, lp), "top_logprobs": [item(t, v) for t, v in top]} for tid, (lp, top) in zip(token_ids, entries)
    ]


def completion_logprobs(tokenizer, token_ids: list[int], entries: list, offset: int = 0) -> dict:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs (token -> logprob), text_offset."""
    tokens = [token_text(tokenizer, t) for t in token_ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _ in entries],
        "top_logprobs": [{token_text(tokenizer, t): v for t, v in top} for _, top in entries],
        "text_offset": offsets,
    }


async def merged(streams: list) -> AsyncIterator[tuple[int, object]]:
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


async def full_response(
    model, streams: list, base, chat: bool, prompt_tokens: int, tools: bool = False, reasoning=None
) -> web.Response:
    n = len(streams)
    text, count, last = [[] for _ in range(n)], 0, [None] * n
    token_ids, entries, want = [[] for _ in range(n)], [[] for _ in range(n)], False
    async for i, out in merged(streams):
        text[i].append(out.text)
        count += len(out.token_ids)
        last[i] = out
        if out.logprobs is not None:
            want = True
            token_ids[i] += out.token_ids
            entries[i] += out.logprobs
    for out in last:
        model.monitor.on_request_done(out.metrics, out.finish_reason if not out.error else None)
    failed = next((out for out in last if out.error), None)
    if failed is not None:
        raise ApiError(500, failed.error, None, "engine_error", "server_error")
    choices, thought_tokens = [], 0
    for i in range(n):
        # the thinking apart; calls and JSON are read from the answer
        thought, content, calls = split_answer("".join(text[i]), reasoning if chat else None, tools)
        thought_tokens += len(model.tokenizer.encode(thought)) if thought else 0
        choice = {"index": i, "finish_reason": last[i].finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": content}
            if thought:
                choice["message"]["reasoning_content"] = thought
            if calls:
                choice["message"]["tool_calls"] = calls
                choice["finish_reason"] = "tool_calls"
            choice["logprobs"] = {"content": chat_logprobs(model.tokenizer, token_ids[i], entries[i])} if want else None
        else:
            choice.update(
                text=content, logprobs=completion_logprobs(model.tokenizer, token_ids[i], entries[i]) if want else None
            )
        choices.append(choice)
    return web.json_response(
        {
            **base,
            "object": "chat.completion" if chat else "text_completion",
            "choices": choices,
            "usage": usage(last[0].metrics, prompt_tokens, count, thought_tokens),
            "minibatch": timings(last[0].metrics),
        }
    )


async def stream_response(
    request,
    state,
    model,
    streams: list,
    base,
    chat: bool,
    prompt_tokens: int,
    include_usage: bool,
    tools: bool = False,
    reasoning=None,
):
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": base["id"]}
    )
    await resp.prepare(request)
    obj = "chat.completion.chunk" if chat else "text_completion"
    n = len(streams)

    async def send(payload: dict) -> None:
        await resp.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")

    offsets = [0] * n  # completions' text_offset runs across chunks

    def chunk(i: int, delta_text: str | None, finish: str | None, role: bool = False, out=None, delta=None) -> dict:
        lp = None
        if out is not None and out.logprobs is not None and out.token_ids:
            if chat:
                lp = {"content": chat_logprobs(model.tokenizer, out.token_ids, out.logprobs)}
            else:
                lp = completion_logprobs(model.tokenizer, out.token_ids, out.logprobs, offsets[i])
                offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
        if chat:
            if delta is None:
                delta = (
                    {"role": "assistant", "content": ""}
                    if role
                    else ({} if delta_text is None else {"content": delta_text})
                )
            choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": i, "text": delta_text or "", "logprobs": lp, "finish_reason": finish}
        return {**base, "object": obj, "choices": [choice]}

    if chat:
        for i in range(n):
            await send(chunk(i, None, None, role=True))
    count, metrics = 0, None
    answers = [AnswerStream(reasoning if chat else None, tools) for _ in range(n)]
    try:
        async with asyncio.timeout(state.request_timeout):
            async for i, out in merged(streams):
                count += len(out.token_ids)
                if out.error:
                    model.monitor.on_request_done(out.metrics, None)
                    await send(ApiError(500, out.error, None, "engine_error", "server_error").body())
                    break
                carries = out.logprobs is not None and bool(out.token_ids)
                finish = out.finish_reason
                # the reasoning streams apart, before the answer; a tool call is held back and sent whole at the end
                thought, text, found = answers[i].push(out.text, out.finished)
                if thought:
                    await send(chunk(i, None, None, delta={"reasoning_content": thought}))
                if text or (carries and not out.finished):
                    await send(chunk(i, text, None, out=out))
                if found:
                    calls = [{"index": k, **c} for k, c in enumerate(found)]
                    await send(chunk(i, None, None, delta={"tool_calls": calls}))
                    finish = "tool_calls"
                if out.finished:
                    model.monitor.on_request_done(out.metrics, out.finish_reason)
                    final = chunk(i, None, finish, out=None if text else out)
                    final["minibatch"] = timings(out.metrics)
                    await send(final)
                    metrics = metrics or out.metrics
        if include_usage and metrics is not None:
            thought_tokens = sum(len(model.tokenizer.encode(a.thought)) for a in answers if a.thought)
            await send(
                {**base, "object": obj, "choices": [], "usage": usage(metrics, prompt_tokens, count, thought_tokens)}
            )
    except TimeoutError:
        await send(timed_out(state).body())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp

"""A generation's prompts as token ids (pipeline.py's first step, and what a count of tokens counts): the
conversation through the model's chat template with its images' placeholder runs, the prompts encoded as
they are, a fill-in-the-middle prompt in the model's markers, or a reranker's (query, document) pairs; how a
thinking model's output is split; every text that cannot fit the context refused before it is encoded, off
the event loop."""

from __future__ import annotations

from dataclasses import dataclass

from minibatch.engine.core.request import ImageSpan
from minibatch.engine.text.fim import assemble, head_bytes
from minibatch.engine.vision.preprocess import Grid

from ..models.loaded import LoadedModel
from ..protocol import ApiError
from ..state import DaemonState, off_loop
from .images import MEDIA_MARKER, ImageInput, check_images, encode_images, flatten, grids, images_of, read_images
from .images import for_template as images_for_template
from .images import spans as image_spans
from .reasoning import Thinking
from .spec import Generation
from .tools import check_template


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

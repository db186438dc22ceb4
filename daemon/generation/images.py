"""Images in a conversation, as every face hands them to the pipeline: an image part in a message's content
(`{"type": "image", "image": ImageInput}`) where the client put it, read (a base64 `data:` URL, plain base64,
or a `file://` URL inside --media-path), decoded and encoded off the event loop, and turned into the chat
template's form for the model. Each refusal is a 400 naming the field as the client wrote it."""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass

from minibatch.engine.core.request import ImageSpan
from minibatch.engine.vision.images import EncodedImage, ImageEncoder, ImageLayout
from minibatch.engine.vision.preprocess import Grid, ImageError

from ..protocol import ApiError

MEDIA_MARKER = "<__media__>"  # where an image goes in a raw prompt (llama-server's, mtmd's default marker)


@dataclass(frozen=True, slots=True)
class ImageInput:
    """An image as a request sends it, not read yet. `field`: where the client wrote it
    (messages.0.content.1.image_url, images.0); `url`: a `data:` or `file://` URL (OpenAI's, the Responses
    API's), or `b64`: base64 as it is (Ollama's, Anthropic's, llama-server's)."""

    field: str
    url: str | None = None
    b64: str | None = None


def image_part(image: ImageInput) -> dict:
    """A message content part holding an image, in the pipeline's form."""
    return {"type": "image", "image": image}


def images_of(messages: list[dict] | None) -> list[ImageInput]:
    """Every image in the conversation, in order."""
    return [p["image"] for p in _image_parts(messages)]


def _image_parts(messages: list[dict] | None) -> Iterator[dict]:
    for m in messages or ():
        content = m.get("content")
        if isinstance(content, list):
            yield from (p for p in content if p.get("type") == "image")


def check_url(url: str, field: str) -> ImageInput:
    """An image_url as the client gave it: a base64 `data:` URL or a `file://` URL (read under --media-path);
    the daemon fetches nothing over the network."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        msg = "the daemon fetches nothing over the network: send the image as a base64 data: URL"
        raise ApiError(400, f"{field}: {msg}", field, "invalid_image_url")
    if scheme not in ("data", "file"):
        msg = "an image URL must be a base64 data: URL (data:image/png;base64,...) or a file:// URL"
        raise ApiError(400, f"{field}: {msg}", field, "invalid_image_url")
    if scheme == "data":
        head = url[5:].split(",", 1)[0]
        if "," not in url or not head.lower().endswith(";base64"):
            msg = "a data: URL must carry base64 (data:image/png;base64,...)"
            raise ApiError(400, f"{field}: {msg}", field, "invalid_image_url")
    return ImageInput(field, url=url)


def read_bytes(image: ImageInput, media_path: str | None, max_bytes: int) -> bytes:
    """The image's encoded bytes; blocks (base64 decoding, a file read): call it off the loop."""
    if image.b64 is not None:
        return _b64(image.b64, image.field, max_bytes)
    url = image.url or ""
    if url[:5].lower() == "data:":
        return _b64(url.split(",", 1)[1], image.field, max_bytes)
    return _file(url, image.field, media_path, max_bytes)


def _b64(text: str, field: str, max_bytes: int) -> bytes:
    text = "".join(text.split()) if any(c.isspace() for c in text[:80]) else text
    if len(text) // 4 * 3 > max_bytes + 3:  # refused before decoding
        raise _bad(field, f"about {len(text) // 4 * 3} bytes; at most {max_bytes} bytes an image (--max-image-bytes)")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(field, "not base64") from None


def _file(url: str, field: str, media_path: str | None, max_bytes: int) -> bytes:
    if media_path is None:
        raise _bad(field, "file:// URLs are read only inside the folder --media-path names, and it is not set")
    parsed = urllib.parse.urlsplit(url)
    if parsed.netloc not in ("", "localhost"):
        raise _bad(field, "a file:// URL names a file on this machine (file:///path)")
    root = os.path.realpath(media_path)
    path = os.path.realpath(os.path.join(root, urllib.parse.unquote(parsed.path).lstrip("/")))
    if os.path.commonpath([root, path]) != root or not os.path.isfile(path):
        raise _bad(field, "no such file inside --media-path", 404)
    size = os.path.getsize(path)
    if size > max_bytes:
        raise _bad(field, f"{size} bytes; at most {max_bytes} bytes an image (--max-image-bytes)")
    with open(path, "rb") as f:
        return f.read(max_bytes + 1)


def _bad(field: str, why: str, status: int = 400) -> ApiError:
    return ApiError(status, f"{field}: {why}", field, "invalid_image")


def check_images(model_name: str, encoder: ImageEncoder | None, images: list[ImageInput]) -> None:
    """Before anything is read: images to a model that sees none, or more than --max-images."""
    if not images:
        return
    if encoder is None:
        field = images[0].field
        msg = f"model {model_name} does not take images (it has no vision tower; see --mmproj)"
        raise ApiError(400, f"{field}: {msg}", field, "model_not_supported")
    most = encoder.limits.max_images
    if len(images) > most:
        field = images[most].field
        raise _bad(field, f"{len(images)} images; at most {most} a request (--max-images)")


def read_images(encoder: ImageEncoder, images: list[ImageInput], media_path: str | None) -> list[bytes]:
    """Each image's bytes (base64 decoded, a file read); blocks: call it off the loop."""
    return [read_bytes(image, media_path, encoder.limits.max_image_bytes) for image in images]


def grids(encoder: ImageEncoder, images: list[ImageInput], data: list[bytes]) -> list[Grid]:
    """How the processor cuts each image (the prompt's layout of it), from its header; blocks: call it off the
    loop."""
    out = []
    for image, raw in zip(images, data):
        try:
            out.append(encoder.grid(raw))
        except ImageError as exc:
            raise _bad(image.field, _with_option(exc)) from None
    return out


def _with_option(exc: ImageError) -> str:
    return f"{exc} (--{exc.option.replace('_', '-')})" if exc.option else str(exc)


async def encode_images(encoder: ImageEncoder, images: list[ImageInput], data: list[bytes]) -> list[EncodedImage]:
    """Each image decoded and through the tower (or found among the recent ones), on the tower's own thread."""
    loop = asyncio.get_running_loop()
    out = []
    for image, raw in zip(images, data):
        try:
            out.append(await loop.run_in_executor(encoder.thread, encoder.encode, raw))
        except ImageError as exc:
            raise _bad(image.field, _with_option(exc)) from None
    return out


def for_template(messages: list[dict], layout: ImageLayout, lists: bool) -> list[dict]:
    """The conversation as the model's chat template reads it: a template that iterates content parts (Gemma
    3's, SmolVLM's) gets `{"type": "image"}` parts, and a text message as one text part (SmolVLM's reads every
    message's parts); another gets the layout's marker in the message's text where each image is."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str) and lists:
            out.append({**m, "content": [{"type": "text", "text": content}]})
            continue
        if not isinstance(content, list):
            out.append(m)
            continue
        if lists:
            parts = [{"type": "image"} if p["type"] == "image" else p for p in content]
            out.append({**m, "content": parts})
        else:
            text = "".join(layout.marker if p["type"] == "image" else p.get("text", "") for p in content)
            out.append({**m, "content": text})
    return out


def flatten(messages: list[dict]) -> list[dict]:
    """The conversation with its content parts joined into text (no images in it)."""
    return [
        {**m, "content": "".join(p.get("text", "") for p in m["content"])} if isinstance(m.get("content"), list) else m
        for m in messages
    ]


def spans(encoder: ImageEncoder, offsets: list[list[int]], images: list[EncodedImage]) -> tuple[ImageSpan, ...]:
    """Each image's runs (its views) as the engine takes them, in the prompt's order."""
    return tuple(span for runs, image in zip(offsets, images) for span in encoder.spans(runs, image))

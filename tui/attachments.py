"""Images attached to a pane's next message: a path typed, pasted or dropped into the input (a terminal
pastes a dropped file's path, quoted or with its spaces escaped, or as a file:// URI), checked before it is
attached; sent as base64 data: URLs in OpenAI's content parts; drawn in the transcript as a thumbnail of
half-block cells (textual-image's)."""

from __future__ import annotations

import base64
import shlex
import urllib.parse
from pathlib import Path

IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp"}
IMAGE_TYPES |= {".gif": "image/gif", ".bmp": "image/bmp"}
MAX_IMAGE_BYTES = 20 * 2**20  # the daemon's default --max-image-bytes: a larger one is refused there anyway
THUMB_WIDTH = 24  # cells a thumbnail is wide at most (half-block cells: two pixel rows a cell)


def image_problem(path: Path) -> str | None:
    """Why `path` cannot be attached, or None."""
    if path.suffix.lower() not in IMAGE_TYPES:
        return f"{path.name}: not an image file ({', '.join(sorted(IMAGE_TYPES))})"
    if not path.is_file():
        return f"{path}: no such file"
    size = path.stat().st_size
    if size > MAX_IMAGE_BYTES:
        return f"{path.name}: {size >> 20} MiB; at most {MAX_IMAGE_BYTES >> 20} MiB an image"
    return None


def _as_path(word: str) -> Path:
    if word.startswith("file://"):
        word = urllib.parse.unquote(urllib.parse.urlsplit(word).path)
    return Path(word).expanduser()


def split_attachment(text: str) -> tuple[Path | None, str]:
    """(an image file the input starts with, the rest of the input); (None, text) when it starts with none.
    The path may be quoted or have its spaces escaped, as terminals paste a dropped file's."""
    text = text.strip()
    if not text:
        return None, text
    try:
        lexer = shlex.shlex(text, posix=True)
        lexer.whitespace_split = True
        first = lexer.get_token() or ""
        rest = lexer.instream.read()
    except ValueError:  # an unclosed quote: not a path
        return None, text
    path = _as_path(first)
    if path.suffix.lower() not in IMAGE_TYPES or not path.is_file():
        return None, text
    return path, rest.strip()


def data_url(path: Path) -> str:
    return f"data:{IMAGE_TYPES[path.suffix.lower()]};base64," + base64.b64encode(path.read_bytes()).decode()


def api_messages(messages: list[dict]) -> list[dict]:
    """A pane's conversation as the chat API takes it: a message's attached images as image_url parts before
    its text (read now: a file gone since is left out and said so in the text)."""
    out = []
    for m in messages:
        images = m.get("images")
        if not images:
            out.append({"role": m["role"], "content": m["content"]})
            continue
        parts: list[dict] = []
        for p in map(Path, images):
            if image_problem(p) is None:
                parts.append({"type": "image_url", "image_url": {"url": data_url(p)}})
            else:
                parts.append({"type": "text", "text": f"[image {p.name} is gone]\n"})
        out.append({"role": m["role"], "content": [*parts, {"type": "text", "text": m["content"]}]})
    return out


def thumbnail(path: Path, width: int = THUMB_WIDTH):
    """A rich renderable of the image in half-block cells, at most `width` cells wide and as many rows as keep
    its shape; or a line saying it cannot be drawn."""
    from rich.text import Text

    try:
        from PIL import Image
        from textual_image.renderable import HalfcellImage

        with Image.open(path) as image:
            image.load()
            w, h = image.size
            cells = max(1, min(width, w))
            rows = max(1, round(h / w * cells / 2))
            return HalfcellImage(image.convert("RGB"), width=cells, height=rows)
    except Exception as exc:  # noqa: BLE001 - any unreadable image is drawn as its name
        return Text(f"[{path.name}: cannot draw it ({type(exc).__name__})]", style="dim")

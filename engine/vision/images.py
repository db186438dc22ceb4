"""A vision model's images as a prompt takes them: where an image goes in the rendered conversation (its
layout: the marker the chat template writes, what the processor makes of it), and the encoder that turns an
image's bytes into its embeddings, within the daemon's bounds, keeping recent ones by content hash so an image
sent again, by any request, is not encoded again. Gemma 3 and Idefics3 (SmolVLM), whose processor cuts a large
image into tiles: each tile, and the whole image, is a view with its own run of positions."""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from minibatch.engine.core.request import ImageSpan

from .idefics3 import Idefics3Processor
from .loader import VisionError, VisionModel
from .preprocess import Grid, ImageError, decode_image, open_image

RUN = None  # in a layout's pieces: one view's run of placeholder positions


@dataclass(frozen=True, slots=True)
class ImageLayout:
    """How an image sits in a prompt. The chat template writes `marker` where the image is (a template that
    does not know images gets it in the message's text); the family's processor makes each marker a sequence
    of pieces (`pieces`): texts, special tokens and one run of `tokens` placeholder positions for each view of
    the image (its tiles and the whole, as the processor cut it). Texts are encoded apart from the special
    tokens, as the tokenizer splits them at special tokens anyway, and texts that meet are encoded together."""

    marker: str
    placeholder: int  # the id in an image's positions (its embeddings take their place)
    tokens: int  # positions a view
    whole: bool  # a view's positions attend to each other, later ones too (Gemma 3)

    def pieces(self, grid: Grid) -> list[str | int | None]:
        raise NotImplementedError

    def positions(self, grid: Grid) -> int:
        """An image's positions in the prompt (its runs and the tokens around them, not the texts)."""
        return sum(self.tokens if p is RUN else 1 for p in self.pieces(grid) if not isinstance(p, str))

    def prompt(
        self, text: str, encode: Callable[[str], list[int]], grids: list[Grid], marker: str | None = None
    ) -> tuple[list[int], list[list[int]]]:
        """The rendered conversation's token ids with each marker (the layout's own, or `marker`) made the
        image's pieces, the i-th marker by `grids[i]` (one view where there are more markers than grids: the
        caller refuses a count that does not match), and each image's runs' offsets."""
        chunks = text.split(marker or self.marker)
        grids = list(grids) + [Grid()] * (len(chunks) - 1 - len(grids))
        ids: list[int] = []
        offsets: list[list[int]] = []
        pending = chunks[0]
        for grid, chunk in zip(grids, chunks[1:]):
            runs = []
            for piece in self.pieces(grid):
                if isinstance(piece, str):
                    pending += piece
                    continue
                ids += encode(pending) if pending else []
                pending = ""
                if piece is RUN:
                    runs.append(len(ids))
                    ids += [self.placeholder] * self.tokens
                else:
                    ids.append(piece)
            offsets.append(runs)
            pending += chunk
        ids += encode(pending) if pending else []
        return ids, offsets


@dataclass(frozen=True, slots=True)
class Gemma3Layout(ImageLayout):
    """Gemma 3's processor: "\n\n<start_of_image>", the image's 256 placeholders, "<end_of_image>\n\n"."""

    start: int = 0
    end: int = 0

    def pieces(self, grid: Grid) -> list[str | int | None]:
        return ["\n\n", self.start, RUN, self.end, "\n\n"]


@dataclass(frozen=True, slots=True)
class Idefics3Layout(ImageLayout):
    """Idefics3's (SmolVLM's) processor: each tile "<fake_token_around_image><row_r_col_c>" and its run, a
    newline after each row of tiles, then "\n<fake_token_around_image><global-img>", the whole image's run and
    "<fake_token_around_image>"; an image of one view only the last part."""

    around: int = 0
    whole_image: int = 0  # <global-img>
    tiles: tuple[tuple[int, ...], ...] = ()  # <row_r_col_c>'s id at [r - 1][c - 1]

    def pieces(self, grid: Grid) -> list[str | int | None]:
        out: list[str | int | None] = []
        for r in range(grid.rows):
            for c in range(grid.cols):
                out += [self.around, self.tiles[r][c], RUN]
            out.append("\n")
        if grid.rows:
            out.append("\n")
        return out + [self.around, self.whole_image, RUN, self.around]


def layout_of(
    vision: VisionModel, vocab: dict[str, int], placeholder: int | None, bounds: tuple[int, int] | None
) -> ImageLayout:
    """The family's layout with the model's ids: its config's (a vision folder's), else its vocabulary's."""

    def ids(*names: str) -> list[int]:
        missing = [t for t in names if t not in vocab]
        if missing:
            shown = " or ".join(missing[:3]) + (f" (and {len(missing) - 3} more)" if len(missing) > 3 else "")
            raise VisionError(f"the tokenizer has no {shown} token, which a {vision.family} image needs")
        return [vocab[t] for t in names]

    tokens = vision.tokens_per_image
    if vision.family == "idefics3":
        processor = vision.processor
        assert isinstance(processor, Idefics3Processor)
        (image,) = [placeholder] if placeholder is not None else ids("<image>")
        around, whole_image = ids("<fake_token_around_image>", "<global-img>")
        largest = processor.largest
        grid = [ids(*(f"<row_{r + 1}_col_{c + 1}>" for c in range(largest.cols))) for r in range(largest.rows)]
        return Idefics3Layout("<image>", image, tokens, False, around, whole_image, tuple(map(tuple, grid)))
    if bounds is None:
        start, end = ids("<start_of_image>", "<end_of_image>")
    else:
        start, end = bounds
    if placeholder is None:
        placeholder = vocab.get("<image_soft_token>", start)  # (any id: the image's embeddings replace it)
    return Gemma3Layout("<start_of_image>", placeholder, tokens, True, start, end)


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What one request may send (the daemon's --max-images, --max-image-bytes, --max-image-pixels)."""

    max_images: int
    max_image_bytes: int
    max_image_pixels: int


# what the API shows of a model's tower (/v1/engine/stats, the engine's events): images of requests waiting for
# it or in it now, and over its life those encoded, those found again among the recent ones, its seconds
IMAGE_COUNTS = ("images_queued", "images_encoded", "image_hits", "image_seconds")


@dataclass(frozen=True, slots=True)
class EncodedImage:
    key: int  # from the image's content hash (the prefix caches key its positions by it)
    embeds: torch.Tensor  # [views, tokens, text width]: each view's run, in the prompt's order


class ImageEncoder:
    """The model's vision tower behind its bounds: bytes decoded (size from the header first), processed and
    encoded one image at a time (the tower's threads are the machine's), the last `keep` outputs kept by
    content hash. An output is kept only while it is among the recent ones; a request holds its own in its
    ImageSpans until it ends."""

    def __init__(self, vision: VisionModel, layout: ImageLayout, limits: ImageLimits, keep: int = 16) -> None:
        self.vision, self.layout, self.limits, self.keep = vision, layout, limits, keep
        self._recent: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        # the tower's own thread: images wait for it here, not on a pool that other work (a text request's
        # template, a body's parse) needs too
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="image-tower")
        self.encoded = 0  # images run through the tower (a hit in the recent ones is not)
        self.hits = 0  # images found among the recent ones
        self.queued = 0  # images of requests waiting for the tower or in it (counted by its caller, on one thread)
        self.seconds = 0.0  # time in the tower, all images together

    def check_size(self, data: bytes) -> None:
        if len(data) > self.limits.max_image_bytes:
            raise ImageError(
                f"{len(data)} bytes; at most {self.limits.max_image_bytes} bytes an image", "max_image_bytes"
            )

    def grid(self, data: bytes) -> Grid:
        """How the processor cuts this image (from its header only), or ImageError."""
        self.check_size(data)
        return self.vision.processor.grid(*open_image(data, self.limits.max_image_pixels).size)

    def encode(self, data: bytes) -> EncodedImage:
        """An image's embeddings, or ImageError saying why it cannot be taken. Blocks: call it off the loop."""
        self.check_size(data)
        digest = hashlib.sha256(data).digest()
        key = int.from_bytes(digest[:8], "little") >> 1
        with self._lock:
            embeds = self._recent.get(digest)
            if embeds is not None:
                self._recent.move_to_end(digest)
                self.hits += 1
                return EncodedImage(key, embeds)
            started = time.perf_counter()
            views = self.vision.processor.views(decode_image(data, self.limits.max_image_pixels))
            embeds = self.vision.encode(views)
            self.seconds += time.perf_counter() - started
            self.encoded += 1
            self._recent[digest] = embeds
            while len(self._recent) > self.keep:
                self._recent.popitem(last=False)
        return EncodedImage(key, embeds)

    def close(self) -> None:
        """Images waiting for the tower are dropped (their requests end with the engine); one in it finishes."""
        self.thread.shutdown(wait=False, cancel_futures=True)

    def counts(self) -> dict[str, float]:
        """What the API shows of it: images waiting or in the tower, encoded, found again, seconds in the tower."""
        values = (self.queued, self.encoded, self.hits, round(self.seconds, 3))
        return dict(zip(IMAGE_COUNTS, values, strict=True))

    def spans(self, offsets: list[int], image: EncodedImage) -> list[ImageSpan]:
        """An image's runs as the engine takes them, one a view (a view's key from the image's and its place)."""
        if len(offsets) != image.embeds.shape[0]:
            raise ValueError(f"{len(offsets)} runs in the prompt for an image of {image.embeds.shape[0]} views")
        whole = self.layout.whole
        return [
            ImageSpan(o, e, image.key if i == 0 else _view_key(image.key, i), whole=whole)
            for i, (o, e) in enumerate(zip(offsets, image.embeds))
        ]


def _view_key(key: int, view: int) -> int:
    digest = hashlib.sha256(key.to_bytes(8, "little") + view.to_bytes(4, "little")).digest()
    return int.from_bytes(digest[:8], "little") >> 1

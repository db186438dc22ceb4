"""A vision model's images as a prompt takes them: where an image goes in the rendered conversation (its
layout: the marker the chat template writes, what the processor makes of it), and the encoder that turns an
image's bytes into its embeddings, within the daemon's bounds, keeping recent ones by content hash so an image
sent again, by any request, is not encoded again."""

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

from .loader import VisionError, VisionModel
from .preprocess import ImageError, decode_image

# What each family's chat template writes where an image is, and what its processor puts around the image's
# placeholder run (Gemma 3's processor: "\n\n<start_of_image>" + 256 x <image_soft_token> + "<end_of_image>\n\n")
_MARKERS = {"gemma3": ("<start_of_image>", "<end_of_image>", "<image_soft_token>", "\n\n", "\n\n")}


@dataclass(frozen=True, slots=True)
class ImageLayout:
    """How an image sits in a prompt. The chat template writes `marker` where the image is (a template that
    does not know images gets it in the message's text); each marker becomes `before`, the `start` token, the
    image's `tokens` placeholder positions, the `end` token and `after`. The texts around are encoded apart from
    the special tokens, as the tokenizer splits them at special tokens anyway."""

    marker: str
    start: int
    end: int
    placeholder: int  # the id in an image's positions (its embeddings take their place)
    tokens: int
    before: str
    after: str
    whole: bool  # the image's positions attend to each other, later ones too (Gemma 3)

    @classmethod
    def of(
        cls, vision: VisionModel, vocab: dict[str, int], placeholder: int | None, bounds: tuple[int, int] | None
    ) -> ImageLayout:
        """The family's layout with the model's ids: its config's (a vision folder's), else its vocabulary's."""
        marker, end, image, before, after = _MARKERS[vision.family]
        if bounds is None:
            missing = [t for t in (marker, end) if t not in vocab]
            if missing:
                msg = f"the tokenizer has no {' or '.join(missing)} token, which a {vision.family} image needs"
                raise VisionError(msg)
            bounds = vocab[marker], vocab[end]
        if placeholder is None:
            placeholder = vocab.get(image, bounds[0])  # (any id: the image's embeddings replace it)
        return cls(marker, *bounds, placeholder, vision.tokens_per_image, before, after, True)

    def prompt(
        self, text: str, encode: Callable[[str], list[int]], marker: str | None = None
    ) -> tuple[list[int], list[int]]:
        """The rendered conversation's token ids with each marker (the layout's own, or `marker`) made an
        image's run, and the runs' offsets."""
        pieces = text.split(marker or self.marker)
        ids: list[int] = []
        offsets = []
        for i, piece in enumerate(pieces):
            if i:
                piece = self.after + piece
            if i < len(pieces) - 1:
                piece = piece + self.before
            ids += encode(piece) if piece else []
            if i < len(pieces) - 1:
                ids.append(self.start)
                offsets.append(len(ids))
                ids += [self.placeholder] * self.tokens
                ids.append(self.end)
        return ids, offsets


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
    embeds: torch.Tensor  # [tokens, text width]


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
            pixels = self.vision.processor.pixels(decode_image(data, self.limits.max_image_pixels))
            embeds = self.vision.encode(pixels[None])[0]
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

    def span(self, offset: int, image: EncodedImage) -> ImageSpan:
        return ImageSpan(offset, image.embeds, image.key, whole=self.layout.whole)

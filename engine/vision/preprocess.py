"""Images as the towers take them: bytes decoded (their size read from the header first, so a decompression
bomb is refused before a pixel is decoded), then each family's processor (resize, rescale, normalise)."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import torch


class ImageError(ValueError):
    """An image that cannot be taken; the message says why (the API names the field), and `option` the bound it
    is past, where it is past one (max_image_pixels, max_image_bytes)."""

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # what a client may send


def open_image(data: bytes, max_pixels: int):
    """A PIL image of an encoded image's bytes with only its header read, or ImageError: not an image, a format
    not taken, or more than `max_pixels` pixels."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))  # (reads the header only)
    except Image.DecompressionBombError:  # past PIL's own bound, far past any a request may send
        raise ImageError(
            f"more pixels than PIL opens; at most {max_pixels} pixels an image", "max_image_pixels"
        ) from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ImageError(
            f"not an image this daemon reads ({type(exc).__name__}); send one of {', '.join(FORMATS)}"
        ) from None
    if image.format not in FORMATS:
        raise ImageError(f"a {image.format} image; send one of {', '.join(FORMATS)}")
    width, height = image.size
    if width < 1 or height < 1 or width * height > max_pixels:
        raise ImageError(f"{width} x {height} pixels; at most {max_pixels} pixels an image", "max_image_pixels")
    return image


def decode_image(data: bytes, max_pixels: int):
    """A PIL image in RGB from an encoded image's bytes, or ImageError (open_image's, or it does not decode)."""
    from PIL import Image

    image = open_image(data, max_pixels)
    try:
        image.load()
        return image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageError(f"the {image.format} image does not decode ({type(exc).__name__})") from None


@dataclass(frozen=True, slots=True)
class Grid:
    """How a processor cuts one image: `rows` x `cols` tiles and then the whole image as one more view, or
    (0, 0): the whole image only. Each view is a run of the image's placeholder positions in the prompt."""

    rows: int = 0
    cols: int = 0

    @property
    def views(self) -> int:
        return self.rows * self.cols + 1 if self.rows else 1


@dataclass(frozen=True, slots=True)
class ImageProcessor:
    """A square resize (bilinear, as Gemma 3's and SigLIP's processors do), values scaled to [0, 1], then
    normalised per channel."""

    size: int
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    largest = Grid()  # (no tiles: one view, whatever the size)

    def grid(self, width: int, height: int) -> Grid:
        return Grid()

    def views(self, image) -> torch.Tensor:
        """[1, 3, size, size]: the one view the tower takes of an RGB PIL image."""
        return self.pixels(image)[None]

    def pixels(self, image) -> torch.Tensor:
        """[3, size, size] float32 from an RGB PIL image."""
        from PIL import Image

        resized = image.resize((self.size, self.size), Image.Resampling.BILINEAR)
        x = np.asarray(resized, dtype=np.float32) * np.float32(1 / 255)
        x = (x - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))

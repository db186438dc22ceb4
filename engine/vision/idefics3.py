"""Idefics3's (SmolVLM's) processor and connector. The processor resizes an image so its longest edge is
`longest_edge` (upscaling a small one, as Idefics3's does), then to whole multiples of the tower's square and
cuts it into those squares, row by row, the whole image shrunk to one more square after them; an image already
one square is that square alone. The connector folds each `scale` x `scale` block of patch states into one
token (pixel shuffle) and projects it into the text model's width with one matrix."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .preprocess import Grid

_MAX_SIDE = 4096  # the processor's bound on the first resize


def _first_size(width: int, height: int, longest: int) -> tuple[int, int]:
    """The longest edge made `longest` (the other rounded down, then up to even), within 4096 a side."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        width, height = int(longest * aspect), longest
        width += width % 2
    width, height = max(width, 1), max(height, 1)
    if width >= height and width > _MAX_SIDE:
        width, height = _MAX_SIDE, int(_MAX_SIDE / aspect)
    elif height > width and height > _MAX_SIDE:
        width, height = int(_MAX_SIDE * aspect), _MAX_SIDE
    return max(width, 1), max(height, 1)


def _tiled_size(width: int, height: int, tile: int) -> tuple[int, int]:
    """Both sides made whole multiples of the tile, the longer first and the other from the aspect."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return width, height


@dataclass(frozen=True, slots=True)
class Idefics3Processor:
    size: int  # the tower's square, pixels a side
    longest_edge: int  # the first resize's longest edge
    split: bool = True  # cut into squares (else the whole image only, resized to one square)
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @property
    def largest(self) -> Grid:
        """The grid of the largest image (its longest edge is resized to `longest_edge`: so many tiles a side)."""
        side = math.ceil(self.longest_edge / self.size) if self.split else 1
        return Grid(side, side) if side > 1 else Grid()

    def _sizes(self, width: int, height: int) -> tuple[tuple[int, int], tuple[int, int] | None]:
        first = _first_size(width, height, self.longest_edge)
        return first, (_tiled_size(*first, self.size) if self.split else None)

    def grid(self, width: int, height: int) -> Grid:
        _, tiled = self._sizes(width, height)
        if tiled is None or (tiled[0] <= self.size and tiled[1] <= self.size):
            return Grid()
        return Grid(tiled[1] // self.size, tiled[0] // self.size)

    def views(self, image) -> torch.Tensor:
        """[views, 3, size, size] float32 from an RGB PIL image: its tiles row by row, then the whole image."""
        from PIL import Image

        lanczos = Image.Resampling.LANCZOS
        first, tiled = self._sizes(*image.size)
        image = image.resize(first, lanczos)
        s = self.size
        if tiled is None:
            frames = [image.resize((s, s), lanczos)]
        else:
            image = image.resize(tiled, lanczos)
            rows, cols = tiled[1] // s, tiled[0] // s
            frames = [image.crop((c * s, r * s, c * s + s, r * s + s)) for r in range(rows) for c in range(cols)]
            if len(frames) > 1:
                frames.append(image.resize((s, s), lanczos))
        x = np.stack([np.asarray(f, dtype=np.float32) for f in frames]) * np.float32(1 / 255)
        x = (x - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))


class Idefics3Connector:
    def __init__(self, proj: torch.Tensor, patches_per_side: int, scale: int) -> None:
        if patches_per_side % scale:
            raise ValueError(f"scale_factor {scale} does not divide the {patches_per_side} patches a side")
        self.proj = proj  # [vision width x scale^2, text width]
        self.patches_per_side, self.scale = patches_per_side, scale
        self.tokens_per_image = (patches_per_side // scale) ** 2

    @property
    def text_width(self) -> int:
        return self.proj.shape[1]

    @torch.inference_mode()
    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """[N, P, D] patch states -> [N, tokens_per_image, text width]: each token the `scale` x `scale` patches
        of one block, in the order Idefics3's pixel shuffle lays them out."""
        n, p, d = states.shape
        side, s = self.patches_per_side, self.scale
        x = states.reshape(n, side, side // s, d * s).permute(0, 2, 1, 3)
        x = x.reshape(n, side // s, side // s, d * s * s).permute(0, 2, 1, 3)
        x = x.reshape(n, p // (s * s), d * s * s)
        if x.shape[-1] != self.proj.shape[0]:
            raise ValueError(f"projection takes {self.proj.shape[0]} values a token, the tower gives {x.shape[-1]}")
        return x @ self.proj

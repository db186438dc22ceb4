"""Gemma 3's projector: the tower's 64 x 64 patch states averaged in 4 x 4 squares (256 tokens an image at
896 px), an RMS norm (Gemma's `1 + weight`), then one matrix into the text model's width."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Gemma3Projector:
    def __init__(
        self, norm_w: torch.Tensor, proj: torch.Tensor, patches_per_side: int, tokens_per_image: int, eps: float
    ) -> None:
        side = round(tokens_per_image**0.5)
        if side * side != tokens_per_image or patches_per_side % side:
            raise ValueError(
                f"mm_tokens_per_image {tokens_per_image} is not a square whose side divides the "
                f"{patches_per_side} patches a side"
            )
        if proj.shape[0] != norm_w.shape[0]:
            raise ValueError(f"projection is {tuple(proj.shape)}, the tower's width is {norm_w.shape[0]}")
        self.norm_w, self.proj = norm_w, proj  # proj: [vision width, text width]
        self.patches_per_side, self.kernel = patches_per_side, patches_per_side // side
        self.tokens_per_image, self.eps = tokens_per_image, eps

    @property
    def text_width(self) -> int:
        return self.proj.shape[1]

    @torch.inference_mode()
    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """[N, P, D] patch states -> [N, tokens_per_image, text width]."""
        n, _, d = states.shape
        side = self.patches_per_side
        grid = states.transpose(1, 2).reshape(n, d, side, side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        x = pooled.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.norm_w.float())
        return (x.to(states.dtype) @ self.proj).to(states.dtype)

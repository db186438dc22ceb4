"""SigLIP's vision transformer, the tower of Gemma 3 (and of SmolVLM / Idefics3): an image cut into square
patches, each patch a token (a convolution whose stride is its kernel), a learned position per patch, then
pre-norm encoder layers (bidirectional attention with biases, a tanh-GELU MLP) and a final LayerNorm.
Each image is its own sequence (VisionModel.encode passes one at a time)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class SiglipConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int  # pixels a side, as the processor resizes to
    patch_size: int
    layer_norm_eps: float = 1e-6

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side**2

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size {self.hidden_size} is not a multiple of its {self.num_heads} heads")
        if self.image_size % self.patch_size:
            raise ValueError(f"vision image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")


@dataclass(slots=True)
class SiglipLayer:
    ln1_w: torch.Tensor
    ln1_b: torch.Tensor
    qkv_w: torch.Tensor  # [3D, D]: q, k and v stacked
    qkv_b: torch.Tensor
    out_w: torch.Tensor
    out_b: torch.Tensor
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor
    fc1_w: torch.Tensor
    fc1_b: torch.Tensor
    fc2_w: torch.Tensor
    fc2_b: torch.Tensor


class SiglipTower:
    """The tower's weights (float32) and its forward: pixels [N, 3, S, S] -> patch states [N, P, D]."""

    def __init__(
        self,
        config: SiglipConfig,
        patch_w: torch.Tensor,
        patch_b: torch.Tensor,
        positions: torch.Tensor,
        layers: list[SiglipLayer],
        post_w: torch.Tensor,
        post_b: torch.Tensor,
    ) -> None:
        c = config
        if tuple(patch_w.shape) != (c.hidden_size, 3, c.patch_size, c.patch_size):
            raise ValueError(
                f"patch embedding is {tuple(patch_w.shape)}, the config says {c.hidden_size} x 3 x "
                f"{c.patch_size} x {c.patch_size}"
            )
        if tuple(positions.shape) != (c.num_patches, c.hidden_size):
            raise ValueError(
                f"position embedding is {tuple(positions.shape)}, the config says {c.num_patches} x {c.hidden_size}"
            )
        if len(layers) != c.num_layers:
            raise ValueError(f"{len(layers)} vision layers, the config says {c.num_layers}")
        self.config = c
        self.patch_w, self.patch_b, self.positions = patch_w, patch_b, positions
        self.layers = layers
        self.post_w, self.post_b = post_w, post_b

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        c = self.config
        n = pixels.shape[0]
        if tuple(pixels.shape[1:]) != (3, c.image_size, c.image_size):
            raise ValueError(
                f"pixels are {tuple(pixels.shape)}, the tower takes N x 3 x {c.image_size} x {c.image_size}"
            )
        x = F.conv2d(pixels.to(self.patch_w.dtype), self.patch_w, self.patch_b, stride=c.patch_size)
        x = x.flatten(2).transpose(1, 2) + self.positions  # [N, P, D]
        heads, d = c.num_heads, c.hidden_size
        hd = d // heads
        for layer in self.layers:
            h = F.layer_norm(x, (d,), layer.ln1_w, layer.ln1_b, c.layer_norm_eps)
            q, k, v = F.linear(h, layer.qkv_w, layer.qkv_b).view(n, -1, 3, heads, hd).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, scale=hd**-0.5)  # every patch sees every patch
            x = x + F.linear(a.transpose(1, 2).reshape(n, -1, d), layer.out_w, layer.out_b)
            h = F.layer_norm(x, (d,), layer.ln2_w, layer.ln2_b, c.layer_norm_eps)
            h = F.gelu(F.linear(h, layer.fc1_w, layer.fc1_b), approximate="tanh")
            x = x + F.linear(h, layer.fc2_w, layer.fc2_b)
        return F.layer_norm(x, (d,), self.post_w, self.post_b, c.layer_norm_eps)

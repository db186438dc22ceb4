"""A vision model's tower and projector, from a Hugging Face folder (safetensors beside config.json's
`vision_config`) or from llama.cpp's `mmproj` GGUF (what `convert_hf_to_gguf.py --mmproj` writes and Ollama and
LM Studio ship beside a text GGUF). Gemma 3 so far; each family's processor comes with it."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from minibatch.engine.models.config import ModelSettingError

from .gemma3 import Gemma3Projector
from .preprocess import ImageProcessor
from .siglip import SiglipConfig, SiglipLayer, SiglipTower

FAMILIES = ("gemma3",)


class VisionError(ModelSettingError):
    """A vision tower that cannot be loaded; the message says why and names no server path."""


@dataclass(slots=True)
class VisionModel:
    family: str
    tower: SiglipTower
    projector: Gemma3Projector
    processor: ImageProcessor

    @property
    def tokens_per_image(self) -> int:
        return self.projector.tokens_per_image

    @property
    def text_width(self) -> int:
        return self.projector.text_width

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, 3, S, S] processed images -> [N, tokens_per_image, text width]: what takes the place of each
        image's placeholder tokens in the text model's input. One image at a time: the matrix multiplies
        then always see the same shapes, so an image's embeddings are the same bits whatever is encoded with it
        (an image is already a few thousand rows at 896 px: a batch of them would buy little)."""
        return torch.cat([self.projector.forward(self.tower.forward(p[None])) for p in pixels])


def _layer(get: Callable[[str], torch.Tensor], names: dict[str, str], i: int) -> SiglipLayer:
    def t(key: str) -> torch.Tensor:
        return get(names[key].format(i=i))

    return SiglipLayer(
        ln1_w=t("ln1_w"),
        ln1_b=t("ln1_b"),
        qkv_w=torch.cat([t("q_w"), t("k_w"), t("v_w")]),
        qkv_b=torch.cat([t("q_b"), t("k_b"), t("v_b")]),
        out_w=t("o_w"),
        out_b=t("o_b"),
        ln2_w=t("ln2_w"),
        ln2_b=t("ln2_b"),
        fc1_w=t("fc1_w"),
        fc1_b=t("fc1_b"),
        fc2_w=t("fc2_w"),
        fc2_b=t("fc2_b"),
    )


_HF_LAYER = {
    "ln1_w": "encoder.layers.{i}.layer_norm1.weight",
    "ln1_b": "encoder.layers.{i}.layer_norm1.bias",
    "q_w": "encoder.layers.{i}.self_attn.q_proj.weight",
    "q_b": "encoder.layers.{i}.self_attn.q_proj.bias",
    "k_w": "encoder.layers.{i}.self_attn.k_proj.weight",
    "k_b": "encoder.layers.{i}.self_attn.k_proj.bias",
    "v_w": "encoder.layers.{i}.self_attn.v_proj.weight",
    "v_b": "encoder.layers.{i}.self_attn.v_proj.bias",
    "o_w": "encoder.layers.{i}.self_attn.out_proj.weight",
    "o_b": "encoder.layers.{i}.self_attn.out_proj.bias",
    "ln2_w": "encoder.layers.{i}.layer_norm2.weight",
    "ln2_b": "encoder.layers.{i}.layer_norm2.bias",
    "fc1_w": "encoder.layers.{i}.mlp.fc1.weight",
    "fc1_b": "encoder.layers.{i}.mlp.fc1.bias",
    "fc2_w": "encoder.layers.{i}.mlp.fc2.weight",
    "fc2_b": "encoder.layers.{i}.mlp.fc2.bias",
}
_GGUF_LAYER = {
    "ln1_w": "v.blk.{i}.ln1.weight",
    "ln1_b": "v.blk.{i}.ln1.bias",
    "q_w": "v.blk.{i}.attn_q.weight",
    "q_b": "v.blk.{i}.attn_q.bias",
    "k_w": "v.blk.{i}.attn_k.weight",
    "k_b": "v.blk.{i}.attn_k.bias",
    "v_w": "v.blk.{i}.attn_v.weight",
    "v_b": "v.blk.{i}.attn_v.bias",
    "o_w": "v.blk.{i}.attn_out.weight",
    "o_b": "v.blk.{i}.attn_out.bias",
    "ln2_w": "v.blk.{i}.ln2.weight",
    "ln2_b": "v.blk.{i}.ln2.bias",
    "fc1_w": "v.blk.{i}.ffn_up.weight",
    "fc1_b": "v.blk.{i}.ffn_up.bias",
    "fc2_w": "v.blk.{i}.ffn_down.weight",
    "fc2_b": "v.blk.{i}.ffn_down.bias",
}


def _getter(tensors: dict[str, torch.Tensor], what: str) -> Callable[[str], torch.Tensor]:
    def get(name: str) -> torch.Tensor:
        t = tensors.get(name)
        if t is None:
            raise VisionError(f"{what}: tensor {name} is missing")
        return t.float().contiguous()

    return get


def _build(
    config: SiglipConfig,
    get,
    names: dict[str, str],
    top: dict[str, str],
    tokens: int,
    norm_plus_one: bool,
    processor: ImageProcessor,
) -> VisionModel:
    try:
        patch_w = get(top["patch_w"]).reshape(config.hidden_size, 3, config.patch_size, config.patch_size)
        tower = SiglipTower(
            config,
            patch_w,
            get(top["patch_b"]),
            get(top["positions"]),
            [_layer(get, names, i) for i in range(config.num_layers)],
            get(top["post_w"]),
            get(top["post_b"]),
        )
        norm_w = get(top["norm"])
        if norm_plus_one:  # llama.cpp's converter stores Gemma's norm as 1 + weight
            norm_w = norm_w - 1.0
        projector = Gemma3Projector(norm_w, get(top["proj"]), config.patches_per_side, tokens, config.layer_norm_eps)
    except (ValueError, RuntimeError) as exc:
        if isinstance(exc, VisionError):
            raise
        raise VisionError(f"the vision tower does not fit its config: {exc}") from None
    return VisionModel("gemma3", tower, projector, processor)


def load_hf(folder: str | Path) -> VisionModel:
    """Gemma 3's tower and projector from a Hugging Face folder (Gemma3ForConditionalGeneration's
    `vision_tower` and `multi_modal_projector`, under the hub's names or transformers 5's)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise VisionError(f"no readable config.json ({type(exc).__name__})") from None
    if cfg.get("model_type") not in FAMILIES or "vision_config" not in cfg:
        raise VisionError(f"a {cfg.get('model_type')!r} folder has no vision tower read here ({', '.join(FAMILIES)})")
    v = cfg["vision_config"]
    config = SiglipConfig(
        hidden_size=v["hidden_size"],
        intermediate_size=v["intermediate_size"],
        num_layers=v["num_hidden_layers"],
        num_heads=v["num_attention_heads"],
        image_size=v["image_size"],
        patch_size=v["patch_size"],
        layer_norm_eps=v.get("layer_norm_eps", 1e-6),
    )
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        for name, t in load_file(f).items():
            # the hub's checkpoints: vision_tower.vision_model.*; transformers 5 saves vision_tower.*
            name = name.removeprefix("model.").replace("vision_tower.vision_model.", "vision_tower.", 1)
            if name.startswith("vision_tower."):
                tensors[name.removeprefix("vision_tower.")] = t
            elif name.startswith("multi_modal_projector."):
                tensors[name] = t
    prep = {}
    if (folder / "preprocessor_config.json").is_file():
        prep = json.loads((folder / "preprocessor_config.json").read_text())
    processor = ImageProcessor(
        size=config.image_size,
        mean=tuple(prep.get("image_mean", (0.5, 0.5, 0.5))),
        std=tuple(prep.get("image_std", (0.5, 0.5, 0.5))),
    )
    top = {
        "patch_w": "embeddings.patch_embedding.weight",
        "patch_b": "embeddings.patch_embedding.bias",
        "positions": "embeddings.position_embedding.weight",
        "post_w": "post_layernorm.weight",
        "post_b": "post_layernorm.bias",
        "norm": "multi_modal_projector.mm_soft_emb_norm.weight",
        "proj": "multi_modal_projector.mm_input_projection_weight",
    }
    tokens = int(cfg.get("mm_tokens_per_image", 256))
    return _build(config, _getter(tensors, "the folder"), _HF_LAYER, top, tokens, False, processor)


def load_mmproj(path: str | Path) -> VisionModel:
    """Gemma 3's tower and projector from llama.cpp's mmproj GGUF (`clip.projector_type` gemma3)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the file's fault
        raise VisionError(f"not an mmproj file (not GGUF: {type(exc).__name__})") from None

    def meta(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    if meta("general.architecture") != "clip" or not meta("clip.has_vision_encoder", False):
        raise VisionError(f"not an mmproj file with a vision tower (a GGUF of {meta('general.architecture')!r})")
    kind = meta("clip.vision.projector_type") or meta("clip.projector_type")
    if kind not in FAMILIES:
        raise VisionError(f"a {kind!r} projector; read here: {', '.join(FAMILIES)}")
    heads = int(meta("clip.vision.attention.head_count"))
    config = SiglipConfig(
        hidden_size=int(meta("clip.vision.embedding_length")),
        intermediate_size=int(meta("clip.vision.feed_forward_length")),
        num_layers=int(meta("clip.vision.block_count")),
        num_heads=heads,
        image_size=int(meta("clip.vision.image_size")),
        patch_size=int(meta("clip.vision.patch_size")),
        layer_norm_eps=float(meta("clip.vision.attention.layer_norm_epsilon", 1e-6)),
    )
    tensors = {}
    for t in reader.tensors:
        values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        tensors[t.name] = torch.from_numpy(values.reshape(tuple(int(d) for d in reversed(t.shape))).copy())
    scale = int(meta("clip.vision.projector.scale_factor", 4))
    side = config.patches_per_side // scale
    processor = ImageProcessor(
        size=config.image_size,
        mean=tuple(float(x) for x in meta("clip.vision.image_mean", (0.5, 0.5, 0.5))),
        std=tuple(float(x) for x in meta("clip.vision.image_std", (0.5, 0.5, 0.5))),
    )
    top = {
        "patch_w": "v.patch_embd.weight",
        "patch_b": "v.patch_embd.bias",
        "positions": "v.position_embd.weight",
        "post_w": "v.post_ln.weight",
        "post_b": "v.post_ln.bias",
        "norm": "mm.soft_emb_norm.weight",
        "proj": "mm.input_projection.weight",
    }
    return _build(config, _getter(tensors, "the mmproj file"), _GGUF_LAYER, top, side * side, True, processor)


def load_vision(path: str | Path) -> VisionModel:
    """From an mmproj GGUF file or a Hugging Face folder."""
    return load_mmproj(path) if Path(path).is_file() else load_hf(path)

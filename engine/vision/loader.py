"""A vision model's tower and projector, from a Hugging Face folder (safetensors beside config.json's
`vision_config`) or from llama.cpp's `mmproj` GGUF (what `convert_hf_to_gguf.py --mmproj` writes and Ollama and
LM Studio ship beside a text GGUF). Gemma 3 and Idefics3 (SmolVLM), both SigLIP towers; each family's projector
and processor come with it."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from minibatch.engine.models.config import ModelSettingError

from .gemma3 import Gemma3Projector
from .idefics3 import Idefics3Connector, Idefics3Processor
from .preprocess import ImageProcessor
from .siglip import SiglipConfig, SiglipLayer, SiglipTower

FAMILIES = ("gemma3", "idefics3")
# a Hugging Face folder's model_type -> its family (SmolVLM's folders say idefics3, SmolVLM2's smolvlm)
_FOLDER_FAMILIES = {"gemma3": "gemma3", "idefics3": "idefics3", "smolvlm": "idefics3"}


class VisionError(ModelSettingError):
    """A vision tower that cannot be loaded; the message says why and names no server path."""


@dataclass(slots=True)
class VisionModel:
    family: str
    tower: SiglipTower
    projector: Gemma3Projector | Idefics3Connector
    processor: ImageProcessor | Idefics3Processor

    @property
    def tokens_per_image(self) -> int:
        return self.projector.tokens_per_image

    @property
    def text_width(self) -> int:
        return self.projector.text_width

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, 3, S, S] processed views -> [N, tokens_per_image, text width]: what takes the place of each
        view's placeholder tokens in the text model's input. One view at a time: the matrix multiplies
        then always see the same shapes, so a view's embeddings are the same bits whatever is encoded with it
        (a view is already a thousand rows or more at 512 px and up: a batch of them would buy little)."""
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


def _tower(config: SiglipConfig, get, names: dict[str, str], top: dict[str, str]) -> SiglipTower:
    patch_w = get(top["patch_w"]).reshape(config.hidden_size, 3, config.patch_size, config.patch_size)
    return SiglipTower(
        config,
        patch_w,
        get(top["patch_b"]),
        get(top["positions"]),
        [_layer(get, names, i) for i in range(config.num_layers)],
        get(top["post_w"]),
        get(top["post_b"]),
    )


def _build(family: str, make: Callable[[], tuple[SiglipTower, Gemma3Projector | Idefics3Connector]], processor):
    try:
        tower, projector = make()
    except (ValueError, RuntimeError) as exc:
        if isinstance(exc, VisionError):
            raise
        raise VisionError(f"the vision tower does not fit its config: {exc}") from None
    return VisionModel(family, tower, projector, processor)


_HF_TOP = {
    "patch_w": "embeddings.patch_embedding.weight",
    "patch_b": "embeddings.patch_embedding.bias",
    "positions": "embeddings.position_embedding.weight",
    "post_w": "post_layernorm.weight",
    "post_b": "post_layernorm.bias",
}
_GGUF_TOP = {
    "patch_w": "v.patch_embd.weight",
    "patch_b": "v.patch_embd.bias",
    "positions": "v.position_embd.weight",
    "post_w": "v.post_ln.weight",
    "post_b": "v.post_ln.bias",
}


def load_hf(folder: str | Path) -> VisionModel:
    """The tower and projector from a Hugging Face folder: Gemma3ForConditionalGeneration's `vision_tower` and
    `multi_modal_projector` (under the hub's names or transformers 5's), Idefics3's (SmolVLM's) `vision_model`
    and `connector`."""
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise VisionError(f"no readable config.json ({type(exc).__name__})") from None
    family = _FOLDER_FAMILIES.get(cfg.get("model_type"))
    if family is None or "vision_config" not in cfg:
        raise VisionError(f"a {cfg.get('model_type')!r} folder has no vision tower read here ({', '.join(FAMILIES)})")
    v = cfg["vision_config"]
    config = SiglipConfig(
        hidden_size=v.get("hidden_size", 1152),  # (SmolVLM2's folders leave Idefics3's defaults out)
        intermediate_size=v.get("intermediate_size", 3072),
        num_layers=v["num_hidden_layers"],
        num_heads=v.get("num_attention_heads", 16),
        image_size=v["image_size"],
        patch_size=v["patch_size"],
        layer_norm_eps=v.get("layer_norm_eps", 1e-6),
    )
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        for name, t in load_file(f).items():
            # the hub's Gemma 3 checkpoints: vision_tower.vision_model.*; transformers 5 saves vision_tower.*;
            # Idefics3's: model.vision_model.*
            name = name.removeprefix("model.").replace("vision_tower.vision_model.", "vision_tower.", 1)
            for part in ("vision_tower.", "vision_model."):
                if name.startswith(part):
                    tensors[name.removeprefix(part)] = t
            if name.startswith(("multi_modal_projector.", "connector.")):
                tensors[name] = t
    prep = {}
    if (folder / "preprocessor_config.json").is_file():
        prep = json.loads((folder / "preprocessor_config.json").read_text())
    mean = tuple(prep.get("image_mean", (0.5, 0.5, 0.5)))
    std = tuple(prep.get("image_std", (0.5, 0.5, 0.5)))
    get = _getter(tensors, "the folder")
    if family == "idefics3":
        side = int(prep.get("max_image_size", {}).get("longest_edge", config.image_size))
        if side != config.image_size:
            raise VisionError(f"preprocessor max_image_size {side} is not the tower's image_size {config.image_size}")
        longest = int(prep.get("size", {}).get("longest_edge", 4 * side))
        processor = Idefics3Processor(side, longest, bool(prep.get("do_image_splitting", True)), mean, std)
        scale = int(cfg.get("scale_factor", 2))
        return _build(
            family,
            lambda: (
                _tower(config, get, _HF_LAYER, _HF_TOP),
                Idefics3Connector(get("connector.modality_projection.proj.weight").t(), config.patches_per_side, scale),
            ),
            processor,
        )
    tokens = int(cfg.get("mm_tokens_per_image", 256))
    return _build(
        family,
        lambda: (
            _tower(config, get, _HF_LAYER, _HF_TOP),
            Gemma3Projector(
                get("multi_modal_projector.mm_soft_emb_norm.weight"),
                get("multi_modal_projector.mm_input_projection_weight"),
                config.patches_per_side,
                tokens,
                config.layer_norm_eps,
            ),
        ),
        ImageProcessor(config.image_size, mean, std),
    )


def _mmproj_reader(path: str | Path):
    """llama.cpp's mmproj GGUF opened, its metadata getter and its family (`clip.projector_type`, one of
    FAMILIES); a VisionError saying why a file is not one read here."""
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
    return reader, meta, kind


def mmproj_problem(path: str | Path) -> str | None:
    """Why an mmproj GGUF cannot be read here (its header alone: not GGUF, no vision tower, a projector of
    another family), or None."""
    try:
        _mmproj_reader(path)
    except VisionError as exc:
        return str(exc)
    return None


def load_mmproj(path: str | Path) -> VisionModel:
    """The tower and projector from llama.cpp's mmproj GGUF (`clip.projector_type` gemma3 or idefics3)."""
    import gguf

    reader, meta, kind = _mmproj_reader(path)
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
    get = _getter(tensors, "the mmproj file")
    mean = tuple(float(x) for x in meta("clip.vision.image_mean", (0.5, 0.5, 0.5)))
    std = tuple(float(x) for x in meta("clip.vision.image_std", (0.5, 0.5, 0.5)))
    if kind == "idefics3":
        scale = int(meta("clip.vision.projector.scale_factor", 2))
        longest = int(meta("clip.vision.preproc_image_size", 4 * config.image_size))
        return _build(
            kind,
            lambda: (
                _tower(config, get, _GGUF_LAYER, _GGUF_TOP),
                Idefics3Connector(get("mm.model.fc.weight").t(), config.patches_per_side, scale),
            ),
            Idefics3Processor(config.image_size, longest, True, mean, std),
        )
    scale = int(meta("clip.vision.projector.scale_factor", 4))
    side = config.patches_per_side // scale
    return _build(
        kind,
        lambda: (
            _tower(config, get, _GGUF_LAYER, _GGUF_TOP),
            # llama.cpp's converter stores Gemma's norm as 1 + weight
            Gemma3Projector(
                get("mm.soft_emb_norm.weight") - 1.0,
                get("mm.input_projection.weight"),
                config.patches_per_side,
                side * side,
                config.layer_norm_eps,
            ),
        ),
        ImageProcessor(config.image_size, mean, std),
    )


def load_vision(path: str | Path) -> VisionModel:
    """From an mmproj GGUF file or a Hugging Face folder."""
    return load_mmproj(path) if Path(path).is_file() else load_hf(path)

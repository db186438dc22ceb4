"""Tiny random vision models as Hugging Face folders (scripts/dev/make_vision_model.py's): Gemma 3's `tiny` (a
SigLIP tower at 64 px, 16 tokens an image) and SmolVLM's `smolvlm-tiny` (32-px tiles, 4 tokens each, up to 4 x 4
tiles and the whole image), for the tests of images through the daemon; test images; transformers' own answer
for an image; and the folders' towers written as llama.cpp's mmproj GGUF."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

SCRIPTS_DEV = Path(__file__).resolve().parents[1] / "scripts" / "dev"
if str(SCRIPTS_DEV) not in sys.path:
    sys.path.insert(0, str(SCRIPTS_DEV))
from make_vision_model import BOI, EOI, IMAGE, SHAPES  # noqa: E402

TOKENS_PER_IMAGE = SHAPES["tiny"][2]


def save_tiny_smolvlm(path: Path, builtin_model_dir: Path, seed: int = 5) -> Path:
    from make_vision_model import save_smolvlm

    return save_smolvlm(path, builtin_model_dir, "smolvlm-tiny", seed)


def smolvlm_expected(folder: Path, messages_text: str, images: list, tokens: int) -> tuple[list[int], int]:
    """transformers' greedy tokens for the rendered conversation `messages_text` (an `<image>` where each image
    is) with transformers' own Idefics3 processor (its PIL image processor: the tiles, and the prompt's expansion
    of each image), and the prompt's length."""
    import torch
    import transformers
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    seq = json.loads((folder / "processor_config.json").read_text())["image_seq_len"]
    processor = transformers.Idefics3Processor(Idefics3ImageProcessorPil.from_pretrained(folder), tok, seq)
    inputs = processor(text=[messages_text], images=[images], return_tensors="pt", add_special_tokens=False)
    model = transformers.Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    ids = inputs["input_ids"]
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, pixel_values=inputs["pixel_values"], pixel_attention_mask=inputs["pixel_attention_mask"],
            attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
        )  # fmt: skip
    return out[0, ids.shape[1] :].tolist(), ids.shape[1]


def save_tiny_gemma3_vision(path: Path, builtin_model_dir: Path, seed: int = 5) -> Path:
    from make_vision_model import save_gemma3_vision

    return save_gemma3_vision(path, builtin_model_dir, "tiny", seed)


def photo(seed: int, size: tuple[int, int] = (48, 80)):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


def png_bytes(image) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def expected_answer(folder: Path, messages_text: str, image, tokens: int) -> tuple[list[int], int]:
    """transformers' greedy tokens for the rendered conversation `messages_text` (one `<start_of_image>` where
    the image is) with Gemma 3's processor's expansion of the image, and the prompt's length."""
    import torch
    import transformers

    from minibatch.engine.vision.loader import load_hf

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    expanded = messages_text.replace(BOI, f"\n\n{BOI}{IMAGE * TOKENS_PER_IMAGE}{EOI}\n\n")
    ids = tok(expanded, add_special_tokens=False, return_tensors="pt").input_ids
    pixels = load_hf(folder).processor.pixels(image)[None]
    kind = (ids == model.config.image_token_index).long()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, pixel_values=pixels, token_type_ids=kind, max_new_tokens=tokens, do_sample=False,
            min_new_tokens=tokens, attention_mask=torch.ones_like(ids),
        )  # fmt: skip
    return out[0, ids.shape[1] :].tolist(), ids.shape[1]


# a SigLIP tower's tensors as llama.cpp's converter names them in an mmproj
_TOWER_NAMES = {
    "embeddings.patch_embedding": "v.patch_embd",
    "embeddings.position_embedding": "v.position_embd",
    "post_layernorm": "v.post_ln",
}
_LAYER_NAMES = {
    "layer_norm1": "ln1",
    "layer_norm2": "ln2",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.out_proj": "attn_out",
    "mlp.fc1": "ffn_up",
    "mlp.fc2": "ffn_down",
}


def _tower_sizes(writer, cfg: dict) -> None:
    """The tower's sizes as the converter writes them (`clip.vision.*`), from a folder's config."""
    vision = cfg["vision_config"]
    writer.add_uint32("clip.vision.projection_dim", cfg["text_config"]["hidden_size"])
    writer.add_uint32("clip.vision.image_size", vision["image_size"])
    writer.add_uint32("clip.vision.patch_size", vision["patch_size"])
    writer.add_uint32("clip.vision.embedding_length", vision["hidden_size"])
    writer.add_uint32("clip.vision.feed_forward_length", vision["intermediate_size"])
    writer.add_uint32("clip.vision.block_count", vision["num_hidden_layers"])
    writer.add_uint32("clip.vision.attention.head_count", vision["num_attention_heads"])


def _gguf_name(name: str) -> str:
    """A tower tensor's name (below the tower's prefix) as the converter writes it."""
    base, kind = name.rsplit(".", 1)
    if base.startswith("encoder.layers."):
        i, part = base.removeprefix("encoder.layers.").split(".", 1)
        return f"v.blk.{i}.{_LAYER_NAMES[part]}.{kind}"
    return f"{_TOWER_NAMES[base]}.{kind}"


def write_mmproj(folder, out):
    """The folder's tower and projector as llama.cpp's `convert_hf_to_gguf.py --mmproj` writes Gemma 3's:
    `clip` architecture, `clip.vision.*` sizes, `v.*` / `mm.*` tensor names, the soft embedding norm stored as
    1 + weight, the projection in F16, the rest F32 (checked key for key and tensor for tensor, names, types and
    shapes, against what llama.cpp 0c1e570's converter writes from the same folder under the hub's names)."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    vision = cfg["vision_config"]
    side = vision["image_size"] // vision["patch_size"]
    w = {k.removeprefix("model."): v for k, v in load_file(folder / "model.safetensors").items()}
    w = {k.replace("vision_tower.vision_model.", "vision_tower.", 1): v for k, v in w.items()}
    writer = gguf.GGUFWriter(str(out), "clip")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "gemma3")
    writer.add_bool("clip.use_gelu", True)
    _tower_sizes(writer, cfg)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    writer.add_uint32("clip.vision.projector.scale_factor", side // round(cfg["mm_tokens_per_image"] ** 0.5))
    pre = "vision_tower."
    for name, t in w.items():
        if name.startswith("multi_modal_projector."):
            if "norm" in name:
                writer.add_tensor("mm.soft_emb_norm.weight", (t.float() + 1).numpy())
            else:
                writer.add_tensor("mm.input_projection.weight", t.half().numpy())
            continue
        if not name.startswith(pre):
            continue
        writer.add_tensor(_gguf_name(name.removeprefix(pre)), t.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def write_smolvlm_mmproj(folder, out):
    """The folder's tower and connector as llama.cpp's `convert_hf_to_gguf.py --mmproj` writes SmolVLM's
    (`clip.projector_type` idefics3, the processor's longest edge as `clip.vision.preproc_image_size`, the
    layers' matrices and the connector in F16, the embeddings, norms and biases F32; checked key for key and
    tensor for tensor, names, types and shapes, against what llama.cpp 0c1e570's converter writes from the
    same folder)."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    prep = json.loads((folder / "preprocessor_config.json").read_text())
    vision = cfg["vision_config"]
    writer = gguf.GGUFWriter(str(out), "clip")
    writer.add_bool("clip.has_vision_encoder", True)
    _tower_sizes(writer, cfg)
    writer.add_array("clip.vision.image_mean", prep["image_mean"])
    writer.add_array("clip.vision.image_std", prep["image_std"])
    writer.add_string("clip.projector_type", "idefics3")
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", vision.get("layer_norm_eps", 1e-6))
    writer.add_uint32("clip.vision.projector.scale_factor", cfg["scale_factor"])
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.preproc_image_size", prep["size"]["longest_edge"])
    for name, t in load_file(folder / "model.safetensors").items():
        if name == "model.connector.modality_projection.proj.weight":
            writer.add_tensor("mm.model.fc.weight", t.half().numpy())
            continue
        if not name.startswith("model.vision_model."):
            continue
        new = _gguf_name(name.removeprefix("model.vision_model."))
        half = new.startswith("v.blk.") and t.dim() == 2  # (the layers' matrices)
        writer.add_tensor(new, (t.half() if half else t.float()).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out

"""Gemma 3's vision tower and projector against transformers on the same random weights: an image's
embeddings (what takes its placeholder tokens' place) from a Hugging Face folder and from an mmproj GGUF laid
out as llama.cpp's converter writes it; the processor's pixels against transformers' Gemma 3 processor; bad
images refused with the reason."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from minibatch.engine.vision.loader import VisionError, load_hf, load_mmproj, load_vision  # noqa: E402
from minibatch.engine.vision.preprocess import ImageError, ImageProcessor, decode_image  # noqa: E402
from tests.vision_model import write_mmproj  # noqa: E402

VISION = dict(
    hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, image_size=64, patch_size=8
)
TOKENS = 16  # 8 x 8 patches pooled 2 x 2


def _model(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.Gemma3Config(
        text_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            vocab_size=300,
            max_position_embeddings=256,
        ),
        vision_config=dict(model_type="siglip_vision_model", vision_use_head=False, **VISION),
        mm_tokens_per_image=TOKENS,
        image_token_index=299,
        boi_token_index=297,
        eoi_token_index=298,
    )
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # (the projection and the norm start at zero: give them a trained model's spread)
        proj = model.model.multi_modal_projector
        proj.mm_input_projection_weight.normal_(0, 0.2)
        proj.mm_soft_emb_norm.weight.normal_(0, 0.5)
    return model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma3-vision")
    _model().save_pretrained(out)
    return out


def _photo(w: int, h: int, seed: int = 1) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _reference(folder, pixels: torch.Tensor) -> torch.Tensor:
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model.get_image_features(pixel_values=pixels).pooler_output


def test_image_embeddings_from_a_folder_equal_transformers(folder):
    vision = load_hf(folder)
    assert (vision.tokens_per_image, vision.text_width) == (TOKENS, 64)
    pixels = torch.stack([vision.processor.pixels(_photo(64, 64, s)) for s in (1, 2, 3)])
    ours = vision.encode(pixels)
    ref = _reference(folder, pixels)
    assert ours.shape == ref.shape == (3, TOKENS, 64)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    # an image's embeddings are its own whatever else is encoded with it
    torch.testing.assert_close(vision.encode(pixels[1:2])[0], ours[1], atol=0, rtol=0)


def test_the_processor_gives_transformers_pixels():
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    ref = Gemma3ImageProcessorPil(size={"height": 64, "width": 64}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    for w, h in ((64, 64), (200, 90), (31, 77)):  # square, wide, tall
        image = _photo(w, h, w)
        theirs = torch.as_tensor(np.asarray(ref(images=[image], return_tensors="np")["pixel_values"]))[0]
        ours = ImageProcessor(64).pixels(image)
        torch.testing.assert_close(ours, theirs.float(), atol=1e-6, rtol=0)


def test_an_mmproj_gguf_gives_the_folders_embeddings_within_f16s_rounding(folder, tmp_path):
    mmproj = write_mmproj(folder, tmp_path / "mmproj.gguf")
    vision = load_vision(mmproj)
    assert (vision.family, vision.tokens_per_image) == ("gemma3", TOKENS)
    pixels = vision.processor.pixels(_photo(90, 60))[None]
    ours, ref = vision.encode(pixels), load_hf(folder).encode(pixels)
    cos = torch.nn.functional.cosine_similarity(ours[0], ref[0], dim=-1)
    assert cos.min() > 0.9999, cos  # (the projection was rounded to F16 by the file)
    assert not torch.equal(ours, ref)


def test_what_is_not_a_vision_tower_is_refused_with_the_reason(folder, tmp_path):
    text_only = tmp_path / "text"
    text_only.mkdir()
    (text_only / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(VisionError, match="'llama' folder has no vision tower"):
        load_hf(text_only)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    with pytest.raises(VisionError, match="not an mmproj file"):
        load_mmproj(junk)


def _encoded(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def test_bad_images_are_refused_before_decoding():
    ok = decode_image(_encoded(_photo(40, 30), "PNG"), max_pixels=10_000)
    assert ok.size == (40, 30) and ok.mode == "RGB"
    assert decode_image(_encoded(_photo(40, 30).convert("L"), "JPEG"), 10_000).mode == "RGB"
    with pytest.raises(ImageError, match="not an image"):
        decode_image(b"GIF89a but not really", 10_000)
    with pytest.raises(ImageError, match="100 x 200 pixels; at most 10000"):
        decode_image(_encoded(_photo(100, 200), "PNG"), 10_000)
    # a bomb: a small file whose header says 6000 x 6000; refused from the header, never decoded
    bomb = _encoded(Image.new("L", (6_000, 6_000)), "PNG")
    assert len(bomb) < 100_000
    with pytest.raises(ImageError, match="6000 x 6000 pixels; at most 4000000"):
        decode_image(bomb, 4_000_000)
    with pytest.raises(ImageError, match="a TIFF image"):
        decode_image(_encoded(_photo(8, 8), "TIFF"), 10_000)

"""Idefics3's (SmolVLM's) images against transformers on the same random folder: the processor's tiles and
grid against transformers' Idefics3 image processor (its PIL one) for wide, tall, small and square images and
with splitting off; each view's embeddings against Idefics3's get_image_features; the prompt's ids for one and
two images against transformers' Idefics3Processor expansion; the tower from an mmproj GGUF laid out as
llama.cpp's converter writes it."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from PIL import Image  # noqa: E402
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil  # noqa: E402

from minibatch.engine.text.tokenizer import TextTokenizer  # noqa: E402
from minibatch.engine.vision.images import layout_of  # noqa: E402
from minibatch.engine.vision.loader import load_hf, load_vision  # noqa: E402
from minibatch.engine.vision.preprocess import Grid  # noqa: E402
from tests.vision_model import write_smolvlm_mmproj  # noqa: E402

# (height, width): wide, tall, one row of tiles, one column, a small square, a tiny tall sliver
SIZES = [(48, 80), (80, 48), (33, 200), (130, 17), (32, 32), (7, 3)]


def _photo(size: tuple[int, int], seed: int = 1) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def vision(tiny_smolvlm_dir):
    return load_hf(tiny_smolvlm_dir)


@pytest.fixture(scope="module")
def reference(tiny_smolvlm_dir):
    return transformers.Idefics3ForConditionalGeneration.from_pretrained(tiny_smolvlm_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("split", [True, False])
def test_tiles_and_grid_are_transformers(tiny_smolvlm_dir, vision, split):
    theirs = Idefics3ImageProcessorPil.from_pretrained(tiny_smolvlm_dir, do_image_splitting=split)
    ours = dataclasses.replace(vision.processor, split=split)
    grids = set()
    for size in SIZES:
        image = _photo(size)
        ref = theirs(images=[image], return_row_col_info=True)
        pixels = torch.as_tensor(np.asarray(ref["pixel_values"]))[0]
        grid = ours.grid(*image.size)
        assert (grid.rows, grid.cols) == (ref["rows"][0][0], ref["cols"][0][0]), size
        views = ours.views(image)
        assert views.shape == pixels.shape and views.shape[0] == grid.views, size
        torch.testing.assert_close(views, pixels, atol=1e-6, rtol=0)
        grids.add((grid.rows, grid.cols))
    assert grids == ({(3, 4), (4, 3), (1, 4), (4, 1), (4, 4), (4, 2)} if split else {(0, 0)})


def test_each_views_embeddings_are_transformers(vision, reference):
    views = vision.processor.views(_photo((48, 80)))
    ours = vision.encode(views)
    assert ours.shape == (13, vision.tokens_per_image, 64)
    with torch.no_grad():
        theirs = reference.model.get_image_features(
            pixel_values=views[None], pixel_attention_mask=torch.ones(1, 13, 32, 32, dtype=torch.bool)
        )
    theirs = getattr(theirs, "pooler_output", theirs)
    theirs = torch.cat(list(theirs)) if isinstance(theirs, (list, tuple)) else theirs
    torch.testing.assert_close(ours, theirs.reshape(ours.shape), atol=1e-5, rtol=1e-5)
    # a view's embeddings are the same bits whatever else is encoded with it
    torch.testing.assert_close(vision.encode(views[5:6])[0], ours[5], atol=0, rtol=0)


def test_the_prompt_is_transformers_expansion(tiny_smolvlm_dir, vision):
    tok = TextTokenizer(tiny_smolvlm_dir)
    layout = layout_of(vision, tok.vocab(), None, None)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tiny_smolvlm_dir)
    seq = json.loads((tiny_smolvlm_dir / "processor_config.json").read_text())["image_seq_len"]
    processor = transformers.Idefics3Processor(Idefics3ImageProcessorPil.from_pretrained(tiny_smolvlm_dir), hf_tok, seq)
    images = [_photo((48, 80)), _photo((32, 32), 2)]
    tags = _image_tokens(tok)
    for shown in (images[:1], images):
        content = [{"type": "image"}, {"type": "text", "text": "Compare\n these."}]
        if len(shown) == 2:
            content.append({"type": "image"})
        text = tok.render_chat([{"role": "user", "content": content}])
        grids = [vision.processor.grid(*image.size) for image in shown]
        ids, offsets = layout.prompt(text, tok.encode, grids)
        theirs = processor(text=[text], images=[shown], add_special_tokens=False)["input_ids"][0]
        assert ids == list(theirs)
        # each view's run starts where the ids hold the image token, tile after tile
        assert [len(runs) for runs in offsets] == [g.views for g in grids]
        starts = [i for i, t in enumerate(ids) if t == layout.placeholder and (i == 0 or ids[i - 1] != t)]
        assert [o for runs in offsets for o in runs] == starts
        assert sum(layout.positions(g) for g in grids) == sum(t in tags for t in ids)
    assert layout.positions(Grid()) == seq + 3


def _image_tokens(tok) -> set[int]:
    vocab = tok.vocab()
    return {i for name, i in vocab.items() if name.startswith(("<row_", "<image>", "<fake_token", "<global-img>"))}


def test_an_mmproj_gguf_gives_the_folders_embeddings_within_f16s_rounding(tiny_smolvlm_dir, vision, tmp_path):
    mmproj = load_vision(write_smolvlm_mmproj(tiny_smolvlm_dir, tmp_path / "mmproj.gguf"))
    assert (mmproj.family, mmproj.tokens_per_image, mmproj.processor) == ("idefics3", 4, vision.processor)
    views = vision.processor.views(_photo((80, 48)))
    ours, ref = mmproj.encode(views), vision.encode(views)
    cos = torch.nn.functional.cosine_similarity(ours.flatten(0, 1), ref.flatten(0, 1), dim=-1)
    assert cos.min() > 0.999, cos  # (the layers' matrices and the connector were rounded to F16 by the file)
    assert not torch.equal(ours, ref)

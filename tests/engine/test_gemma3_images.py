"""Gemma 3 with an image, end to end in the engine: the tower's embeddings (engine/vision/) in the image's
placeholder positions, and the image's positions attending to each other (later ones too) as Gemma 3's do.
Our greedy tokens equal transformers' Gemma3ForConditionalGeneration given the pixels, alone, beside a text
request and another image, with a step budget that cuts the prompt around the image (never through it), on
the C++ kernel and the PyTorch attention; a prefix hit on the same image gives the same tokens."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from minibatch.engine.core.request import ImageSpan
from minibatch.engine.core.sampling_params import SamplingParams
from minibatch.engine.factory import EngineConfig, build_engine
from minibatch.engine.vision.loader import load_hf
from tests.conftest import TINY_COMMON, TOKENIZER_FILES

IMAGE_TOKEN, TOKENS_PER_IMAGE = 49100, 16
TOKENS = 8


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory, builtin_model_dir):
    torch.manual_seed(5)
    text = transformers.Gemma3TextConfig(
        **{**TINY_COMMON, "vocab_size": 49152, "num_hidden_layers": 4},
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=8,  # (shorter than the prompts: the local layers' windows matter)
        sliding_window_pattern=2,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    vision = dict(
        model_type="siglip_vision_model", hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, image_size=64, patch_size=8, vision_use_head=False,
    )  # fmt: skip
    cfg = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        image_token_index=IMAGE_TOKEN,
        boi_token_index=49098,
        eoi_token_index=49099,
    )
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # give the zero-initialised norms and projection a trained model's spread
        for name, p in model.named_parameters():
            if "norm" in name and "vision_tower" not in name:
                p.normal_(0.0, 0.3)
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.3)
    path = tmp_path_factory.mktemp("tiny-gemma3-vision")
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (builtin_model_dir / name).exists():
            shutil.copy(builtin_model_dir / name, path / name)
    return path


def _photo(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (48, 80, 3), dtype=np.uint8))


# text, the image's run of placeholders, text: the image at 6..21
PROMPT = [2, 106, 1645, 108, 3, 49098] + [IMAGE_TOKEN] * TOKENS_PER_IMAGE + [49099, 4521, 23533, 107, 108, 2516]
OFFSET = 6


def _reference(model, pixels: torch.Tensor | None) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities (these tell a causal image apart: its argmaxes may agree)."""
    ids, logprobs = list(PROMPT), []
    with torch.no_grad():
        for _ in range(TOKENS):
            x = torch.tensor([ids])
            kind = (x == IMAGE_TOKEN).long()
            if pixels is None:  # the same prompt with no image: its placeholders are plain tokens
                logits = model(input_ids=x).logits
            else:
                logits = model(input_ids=x, pixel_values=pixels[None], token_type_ids=kind).logits
            ids.append(int(logits[0, -1].argmax()))
            logprobs.append(float(logits[0, -1].log_softmax(-1)[ids[-1]]))
    return ids[len(PROMPT) :], logprobs


@pytest.fixture(scope="module")
def expected(gemma3_dir):
    vision = load_hf(gemma3_dir)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(gemma3_dir, dtype=torch.float32).eval()
    pixels = {n: vision.processor.pixels(_photo(n)) for n in (1, 2)}
    want = {n: _reference(model, px) for n, px in pixels.items()} | {"text": _reference(model, None)}
    assert len({tuple(v[0]) for v in want.values()}) == 3, want  # (each image gives an answer of its own)
    embeds = {n: vision.encode(px[None])[0] for n, px in pixels.items()}
    return want, embeds


def _engine(model_dir, attention: str, **kw):
    cfg = dict(dtype="float32", weights="native-exact", max_num_seqs=4, num_kv_blocks=64, max_wait_ms=0)
    eng = build_engine(EngineConfig(model=str(model_dir), **{**cfg, **kw}))
    if attention == "torch":  # the PyTorch attention (the reference the kernels are held to)
        from minibatch.engine.attention.torch_backend import TorchAttentionBackend

        for layer in eng.runner.model.model.layers:
            layer.self_attn.backend = TorchAttentionBackend()
        eng.runner.model.backend = TorchAttentionBackend()
    else:
        assert eng.runner.model.backend.name == "cpu-paged"  # (the C++ kernel built, not its twin)
    return eng


def _run(eng, asks, embeds) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=0)
    reqs = []
    for rid, image in asks:
        spans = () if image is None else (ImageSpan(OFFSET, embeds[image], key=image, whole=True),)
        reqs.append(eng.add_request(rid, PROMPT, params, images=spans))
    while eng.has_work():
        eng.step()
    assert eng.scheduler.blocks.num_used_blocks == 0
    return {r.request_id: r for r in reqs}


def _same(req, want: tuple[list[int], list[float]]) -> bool:
    tokens, logprobs = want
    ours = [lp for lp, _ in req.output_logprobs]
    return req.output_token_ids == tokens and max(abs(a - b) for a, b in zip(ours, logprobs)) < 1e-4


@pytest.mark.parametrize("attention", ["kernel", "torch"])
def test_gemma3_with_an_image_equals_transformers(gemma3_dir, expected, attention):
    want, embeds = expected
    eng = _engine(gemma3_dir, attention, enable_prefix_caching=False)
    assert _same(_run(eng, [("one", 1)], embeds)["one"], want[1])
    got = _run(eng, [("one", 1), ("text", None), ("two", 2)], embeds)
    assert _same(got["one"], want[1]) and _same(got["text"], want["text"]) and _same(got["two"], want[2])
    # steps of 20 tokens: the image (16 positions from 6) cannot share the first step with the text before it,
    # so that step stops at the image and the next one takes it whole
    chunked = _engine(gemma3_dir, attention, enable_prefix_caching=False, max_num_batched_tokens=20, max_num_seqs=2)
    got = _run(chunked, [("one", 1), ("two", 2)], embeds)
    assert _same(got["one"], want[1]) and _same(got["two"], want[2])


def test_an_image_attending_causally_is_told_apart(gemma3_dir, expected):
    """(else the test above would pass with the image's positions causal, as a text model's)"""
    want, embeds = expected
    eng = _engine(gemma3_dir, "kernel", enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=0)
    req = eng.add_request("causal", PROMPT, params, images=(ImageSpan(OFFSET, embeds[1], key=1, whole=False),))
    while eng.has_work():
        eng.step()
    assert not _same(req, want[1])


def test_a_prefix_hit_on_the_same_image_gives_the_same_tokens(gemma3_dir, expected):
    want, embeds = expected
    eng = _engine(gemma3_dir, "kernel", block_size=8)  # 8-token blocks: a hit ends inside the image
    first = _run(eng, [("one", 1)], embeds)["one"]
    assert _run(eng, [("two", 2)], embeds)["two"].num_cached_tokens == 0  # (its first block holds image positions)
    again = _run(eng, [("again", 1)], embeds)["again"]
    assert again.num_cached_tokens == 24 and _same(again, want[1]) and _same(first, want[1])


def test_an_image_longer_than_a_step_is_refused(gemma3_dir, expected):
    from minibatch.engine.core.admission import RequestRejected
    from minibatch.engine.models.config import ModelSettingError

    _, embeds = expected
    # a model whose images could never fit a step is refused at its load, naming the option
    with pytest.raises(ModelSettingError, match="max_num_batched_tokens 8: an image takes 16 positions"):
        _engine(gemma3_dir, "kernel", max_num_batched_tokens=8, max_num_seqs=2)
    # and a program's own span longer than a step, at its submission
    eng = _engine(gemma3_dir, "kernel", max_num_batched_tokens=16, max_num_seqs=2)
    long = PROMPT[:OFFSET] + [IMAGE_TOKEN] * 32 + PROMPT[OFFSET + TOKENS_PER_IMAGE :]
    span = ImageSpan(OFFSET, torch.cat([embeds[1], embeds[1]]), 1, True)
    with pytest.raises(RequestRejected, match="more positions than one step computes"):
        eng.add_request("x", long, SamplingParams(max_tokens=2), images=(span,))
    assert not eng.has_work()

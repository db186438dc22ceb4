"""Images in a prompt: a run of placeholder positions whose input embeddings are an image's (what a vision
tower gives), any model. Our greedy tokens equal transformers' with the same `inputs_embeds`, alone, in a
batch beside text-only requests and another image, with chunked prefill cutting through the image; the
prefix cache keys an image's positions by the image: the same image again is a hit, another is not."""

from __future__ import annotations

import pytest
import torch
import transformers

from minibatch.engine.core.request import ImageSpan
from minibatch.engine.core.sampling_params import SamplingParams
from minibatch.engine.factory import EngineConfig, build_engine

PLACEHOLDER = 48000
# the image last (7..26): this tiny random model's next token follows its last position's input, so each image
# gives an answer of its own
PROMPT = [1, 520, 3041, 77, 907, 44, 8] + [PLACEHOLDER] * 20
OFFSET, LENGTH = 7, 20
TOKENS = 10


def _image(seed: int, width: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LENGTH, width, generator=g) * 0.05  # about a token embedding's spread


@pytest.fixture(scope="module")
def reference_model(tiny_chat_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir, dtype=torch.float32).eval()


def _reference(model, image: torch.Tensor | None, prompt=PROMPT) -> list[int]:
    embed = model.get_input_embeddings()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(TOKENS):
            x = embed(torch.tensor([ids]))
            if image is not None:
                x[0, OFFSET : OFFSET + LENGTH] = image
            ids.append(int(model(inputs_embeds=x).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _engine(model_dir, **kw):
    cfg = dict(dtype="float32", weights="native-exact", max_num_seqs=8, num_kv_blocks=64, max_wait_ms=0)
    return build_engine(EngineConfig(model=str(model_dir), **{**cfg, **kw}))


def _run(eng, asks: list[tuple[str, torch.Tensor | None, int]]) -> dict[str, object]:
    """(request id, image or none, its key) submitted at once, run to the end."""
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    reqs = [
        eng.add_request(rid, PROMPT, params, images=() if img is None else (ImageSpan(OFFSET, img, key),))
        for rid, img, key in asks
    ]
    while eng.has_work():
        eng.step()
    assert eng.scheduler.blocks.num_used_blocks == 0
    return {r.request_id: r for r in reqs}


def test_an_images_embeddings_take_its_placeholders_place(tiny_chat_model_dir, reference_model):
    width = reference_model.config.hidden_size
    one, two = _image(1, width), _image(2, width)
    want = {name: _reference(reference_model, img) for name, img in (("one", one), ("two", two), ("text", None))}
    assert len({tuple(v) for v in want.values()}) == 3  # (else the images would change nothing)
    eng = _engine(tiny_chat_model_dir, enable_prefix_caching=False)
    assert _run(eng, [("one", one, 11)])["one"].output_token_ids == want["one"]  # alone
    got = _run(eng, [("one", one, 11), ("text", None, 0), ("two", two, 22)])  # beside text and another image
    assert {k: r.output_token_ids for k, r in got.items()} == want
    # chunked prefill: steps of 6 tokens cut through the image four times
    chunked = _engine(tiny_chat_model_dir, enable_prefix_caching=False, max_num_batched_tokens=6, max_num_seqs=2)
    got = _run(chunked, [("one", one, 11), ("two", two, 22)])
    assert got["one"].output_token_ids == want["one"] and got["two"].output_token_ids == want["two"]


def test_the_prefix_cache_keys_an_images_positions_by_the_image(tiny_chat_model_dir, reference_model):
    width = reference_model.config.hidden_size
    one, two = _image(1, width), _image(2, width)
    eng = _engine(tiny_chat_model_dir)  # 16-token blocks: the first holds 9 of the image's positions
    first = _run(eng, [("one", one, 11)])["one"]
    other = _run(eng, [("two", two, 22)])["two"]
    assert other.num_cached_tokens == 0  # its first block holds image positions: not the first image's
    text = _run(eng, [("text", None, 0)])["text"]
    assert text.num_cached_tokens == 0  # nor are the placeholders' own
    again = _run(eng, [("again", one, 11)])["again"]
    assert again.num_cached_tokens == 16 and again.output_token_ids == first.output_token_ids


def test_images_out_of_place_are_refused(tiny_chat_model_dir):
    eng = _engine(tiny_chat_model_dir)
    params = SamplingParams(max_tokens=2)
    img = torch.zeros(LENGTH, 64)
    with pytest.raises(ValueError, match="within the prompt"):
        eng.add_request("x", PROMPT[:10], params, images=(ImageSpan(OFFSET, img, 1),))
    with pytest.raises(ValueError, match="in order, apart"):
        eng.add_request("y", PROMPT, params, images=(ImageSpan(OFFSET, img[:4], 1), ImageSpan(OFFSET + 2, img[:4], 2)))
    assert not eng.has_work()

"""SmolVLM (Idefics3) through the real daemon: a tiny random folder served as it is, whose processor cuts an image
into tiles and adds the whole image as one more view. Each face's greedy answer for one or two images equals
transformers' own (its Idefics3 processor's tiles and prompt expansion, Idefics3ForConditionalGeneration's
tokens), with the prompt's length it counts, and count_tokens counts the same; a prompt step budget smaller
than an image cuts through its tiles and changes nothing; the same image again is a prefix hit; the tower from
an mmproj GGUF gives the same answer."""

from __future__ import annotations

import base64

import pytest

from minibatch.daemon.client import request_json
from minibatch.engine.text.tokenizer import TextTokenizer
from tests.vision_model import photo, png_bytes, smolvlm_expected, write_smolvlm_mmproj

from .helpers import running_daemon

N = 8
TEXT = "What is in this picture?"
SIZES = {1: (48, 80), 2: (90, 30)}  # (height, width): 3 x 4 tiles and the whole; 4 x 2 and the whole


def _b64(seed: int) -> str:
    return base64.b64encode(png_bytes(photo(seed, SIZES.get(seed, (40, 40))))).decode()


def _url(seed: int) -> str:
    return "data:image/png;base64," + _b64(seed)


@pytest.fixture(scope="module")
def daemon(tiny_smolvlm_dir):
    with running_daemon(tiny_smolvlm_dir, "--kv-cache-gb", "0.05", "--max-num-batched-tokens", "48") as d:
        d.model = d.get("/health")[1]["model"]
        yield d


def _expected(folder, seeds: tuple[int, ...]) -> tuple[str, int]:
    tok = TextTokenizer(folder)
    content = [{"type": "image"} for _ in seeds] + [{"type": "text", "text": TEXT}]
    rendered = tok.render_chat([{"role": "user", "content": content}])
    ids, prompt_len = smolvlm_expected(folder, rendered, [photo(s, SIZES[s]) for s in seeds], N)
    return tok.decode(ids), prompt_len


@pytest.fixture(scope="module")
def one(tiny_smolvlm_dir):
    return _expected(tiny_smolvlm_dir, (1,))


def _openai(daemon, seeds: tuple[int, ...]) -> tuple[int, dict]:
    content = [{"type": "image_url", "image_url": {"url": _url(s)}} for s in seeds]
    body = {"messages": [{"role": "user", "content": [*content, {"type": "text", "text": TEXT}]}]}
    body |= {"max_tokens": N, "temperature": 0, "ignore_eos": True}
    return request_json(str(daemon.socket), "POST", "/v1/chat/completions", body, timeout=120)


def test_tiled_image_gives_transformers_answer_on_two_faces(daemon, one):
    text, prompt_len = one
    status, out = _openai(daemon, (1,))
    assert status == 200, out
    assert out["choices"][0]["message"]["content"] == text
    assert out["usage"]["prompt_tokens"] == prompt_len  # (13 views of 4 positions, the tokens around them)
    msg = {"role": "user", "content": TEXT, "images": [_b64(1)]}
    options = {"num_predict": N, "temperature": 0}
    body = {"model": daemon.model, "messages": [msg], "stream": False, "options": options}
    status, out = request_json(str(daemon.socket), "POST", "/api/chat", body, timeout=120)
    assert status == 200, out
    assert out["message"]["content"] == text and out["prompt_eval_count"] == prompt_len
    status, again = _openai(daemon, (1,))  # the same image again: its blocks are found
    assert status == 200 and again["choices"][0]["message"]["content"] == text
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # (--max-num-batched-tokens 48: the 96-token prompt went in chunks that cut through the image's tiles)
    status, steps = daemon.get("/v1/engine/steps?since=0")
    assert status == 200 and steps["states"]["i"] == "image"
    marks = [[row[3] for row in r["rows"]] for r in steps["steps"]]
    # the first request: both its prompt chunks hold its image's positions and are marked so; then it decodes
    assert marks[:3] == [["i"], ["i"], ["d"]], marks


def test_two_images_of_other_grids(daemon, tiny_smolvlm_dir):
    text, prompt_len = _expected(tiny_smolvlm_dir, (2, 1))
    status, out = _openai(daemon, (2, 1))
    assert status == 200, out
    assert out["choices"][0]["message"]["content"] == text and out["usage"]["prompt_tokens"] == prompt_len
    blocks = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _b64(s)}} for s in (2, 1)
    ]
    content = [*blocks, {"type": "text", "text": TEXT}]
    body = {"model": daemon.model, "messages": [{"role": "user", "content": content}]}
    status, out = request_json(str(daemon.socket), "POST", "/v1/messages/count_tokens", body)
    assert status == 200 and out["input_tokens"] == prompt_len, out


def test_health_says_tiles(daemon):
    vision = daemon.get("/health")[1]["vision"]
    assert vision["family"] == "idefics3" and vision["image_size"] == 32 and vision["tokens_per_image"] == 4
    # 4 x 4 tiles and the whole: 17 runs of 4, 17 <fake_token_around_image> and <row_r_col_c>/<global-img>
    # tokens, the last <fake_token_around_image> (newlines are text, not counted)
    assert vision["max_image_positions"] == 17 * 4 + 17 + 17 + 1


def test_an_mmproj_gguf_tower_gives_the_folders_answer(tiny_smolvlm_dir, one, tmp_path):
    mmproj = write_smolvlm_mmproj(tiny_smolvlm_dir, tmp_path / "mmproj.gguf")
    with running_daemon(tiny_smolvlm_dir, "--kv-cache-gb", "0.05", "--mmproj", str(mmproj)) as d:
        assert d.get("/health")[1]["vision"]["source"] == "mmproj mmproj.gguf"
        status, out = _openai(d, (1,))
    assert status == 200, out
    assert out["choices"][0]["message"]["content"] == one[0]

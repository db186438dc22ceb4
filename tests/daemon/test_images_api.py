"""Images through the real daemon: a tiny random Gemma 3 vision folder served as it is, the same image sent to
every face (OpenAI's chat image_url, Ollama's images, Anthropic's image blocks, the Responses API's
input_image, llama-server's multimodal_data) gets transformers' own greedy answer for it, with the prompt's
length transformers counts; a file:// URL inside --media-path too. Bad images are 400s naming the field as the
client wrote it, and the daemon serves on with no KV block held."""

from __future__ import annotations

import base64

import pytest

from minibatch.daemon.client import request_json
from minibatch.engine.text.tokenizer import TextTokenizer
from tests.vision_model import BOI, expected_answer, photo, png_bytes, write_mmproj

from .helpers import running_daemon

N = 8
TEXT = "What is in this picture?"


@pytest.fixture(scope="module")
def folder(tiny_vision_model_dir):
    return tiny_vision_model_dir


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "cat.png").write_bytes(png_bytes(photo(1)))
    return root


@pytest.fixture(scope="module")
def daemon(folder, media):
    args = ("--kv-cache-gb", "0.05", "--max-images", "2", "--max-image-pixels", "20000", "--media-path", str(media))
    with running_daemon(folder, *args, prefix="mbv-") as d:
        d.model = d.get("/health")[1]["model"]
        yield d


@pytest.fixture(scope="module")
def expected(folder):
    """transformers' greedy answer (as text) and prompt length for TEXT after image 1 in a user message."""
    tok = TextTokenizer(folder)
    rendered = tok.render_chat([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]}])
    assert rendered.count(BOI) == 1
    ids, prompt_len = expected_answer(folder, rendered, photo(1), N)
    return tok.decode(ids), prompt_len, rendered


def _b64(seed: int = 1, size=(48, 80)) -> str:
    return base64.b64encode(png_bytes(photo(seed, size))).decode()


def _url(seed: int = 1) -> str:
    return "data:image/png;base64," + _b64(seed)


def _ask(daemon, face: str, image: dict | str | None = None, images: int = 1) -> tuple[int, dict]:
    """`face` asked for N greedy tokens of TEXT after `images` copies of the image (default: image 1)."""
    sock, model = str(daemon.socket), daemon.model
    if face == "openai":
        part = image or {"type": "image_url", "image_url": {"url": _url()}}
        content = [part] * images + [{"type": "text", "text": TEXT}]
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": N, "temperature": 0}
        return request_json(sock, "POST", "/v1/chat/completions", body, timeout=120)
    if face == "ollama":
        msg = {"role": "user", "content": TEXT, "images": [image or _b64()] * images}
        body = {"model": model, "messages": [msg], "stream": False, "options": {"num_predict": N, "temperature": 0}}
        return request_json(sock, "POST", "/api/chat", body, timeout=120)
    if face == "anthropic":
        block = image or {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _b64()}}
        content = [block] * images + [{"type": "text", "text": TEXT}]
        body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": N, "temperature": 0}
        return request_json(sock, "POST", "/v1/messages", body, timeout=120)
    if face == "responses":
        part = image or {"type": "input_image", "image_url": _url()}
        content = [part] * images + [{"type": "input_text", "text": TEXT}]
        body = {"input": [{"role": "user", "content": content}], "max_output_tokens": N, "temperature": 0}
        return request_json(sock, "POST", "/v1/responses", body, timeout=120)
    raise AssertionError(face)


def _text(face: str, out: dict) -> str:
    if face == "openai":
        return out["choices"][0]["message"]["content"]
    if face == "ollama":
        return out["message"]["content"]
    if face == "anthropic":
        return "".join(b["text"] for b in out["content"] if b["type"] == "text")
    return "".join(c["text"] for item in out["output"] if item["type"] == "message" for c in item["content"])


def _prompt_tokens(face: str, out: dict) -> int:
    return {
        "openai": lambda: out["usage"]["prompt_tokens"],
        "ollama": lambda: out["prompt_eval_count"],
        # (Anthropic counts the prompt's tokens read from the cache apart)
        "anthropic": lambda: out["usage"]["input_tokens"] + out["usage"].get("cache_read_input_tokens", 0),
        "responses": lambda: out["usage"]["input_tokens"],
    }[face]()


FACES = ("openai", "ollama", "anthropic", "responses")


@pytest.mark.parametrize("face", FACES)
def test_every_face_gives_transformers_answer_for_the_image(daemon, expected, face):
    text, prompt_len, _ = expected
    status, out = _ask(daemon, face)
    assert status == 200, out
    assert _text(face, out) == text
    assert _prompt_tokens(face, out) == prompt_len


def test_llama_server_multimodal_data_and_a_file_url(daemon, expected):
    text, prompt_len, rendered = expected
    body = {
        "prompt": {"prompt_string": rendered.replace(BOI, "<__media__>"), "multimodal_data": [_b64()]},
        "n_predict": N,
        "temperature": 0,
        "return_tokens": True,
    }
    status, out = request_json(str(daemon.socket), "POST", "/completion", body, timeout=120)
    assert status == 200, out
    assert out["content"] == text and out["tokens_evaluated"] == prompt_len
    assert len(out["tokens"]) == out["tokens_predicted"] and out["tokens"]
    status, out = _ask(daemon, "openai", {"type": "image_url", "image_url": {"url": "file:///cat.png"}})
    assert status == 200, out
    assert _text("openai", out) == text


def test_counted_tokens_are_the_generation_s_and_props_say_vision(daemon, expected):
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _b64(4)}}
    content = [block, {"type": "text", "text": TEXT}]
    body = {"model": daemon.model, "messages": [{"role": "user", "content": content}]}
    status, out = request_json(str(daemon.socket), "POST", "/v1/messages/count_tokens", body)
    assert status == 200 and out["input_tokens"] == expected[1], out
    content = [{"type": "input_image", "image_url": _url(4)}, {"type": "input_text", "text": TEXT}]
    body = {"input": [{"role": "user", "content": content}]}
    status, out = request_json(str(daemon.socket), "POST", "/v1/responses/input_tokens", body)
    assert status == 200 and out["input_tokens"] == expected[1], out
    status, props = daemon.get("/props")
    assert props["modalities"] == {"vision": True, "audio": False} and props["media_marker"] == "<__media__>"


def test_another_image_another_answer_and_the_same_image_a_prefix_hit(daemon, expected):
    status, other = _ask(daemon, "openai", {"type": "image_url", "image_url": {"url": _url(2)}})
    assert status == 200, other
    assert _text("openai", other) != expected[0]  # (not a prefix hit on image 1's blocks)
    status, again = _ask(daemon, "openai")
    assert status == 200 and _text("openai", again) == expected[0]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


BAD = [
    ("openai", {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "fetches nothing"),
    ("openai", {"type": "image_url", "image_url": {"url": "data:image/png,abc"}}, "base64"),
    ("openai", {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@@"}}, "not base64"),
    ("openai", {"type": "image_url", "image_url": {"url": "file:///../etc/passwd"}}, "no such file"),
    ("ollama", base64.b64encode(b"not an image at all").decode(), "not an image"),
    ("ollama", _b64(3, (200, 200)), "at most 20000 pixels"),
    ("anthropic", {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}, "fetches"),
    ("responses", {"type": "input_image", "file_id": "file-1"}, "keeps no files"),
]
FIELDS = {
    "openai": "messages.0.content.0.image_url",
    "ollama": "messages.0.images.0",
    "anthropic": "messages.0.content.0.source.type",
    "responses": "input.0.content.0.file_id",
}


@pytest.mark.parametrize("face,image,why", BAD)
def test_a_bad_image_is_a_400_naming_its_field(daemon, face, image, why):
    status, out = _ask(daemon, face, image)
    assert status in (400, 404), out
    message = str(out)
    assert why in message and FIELDS[face] in message, out


def test_more_images_than_max_images_names_the_first_past_it(daemon):
    status, out = _ask(daemon, "openai", images=3)
    assert status == 400 and "messages.0.content.2.image_url" in str(out) and "--max-images" in str(out), out


def test_facts_capability_and_nothing_held_after_refusals(daemon, expected):
    status, health = daemon.get("/health")
    vision = health["vision"]
    assert vision["family"] == "gemma3" and vision["tokens_per_image"] == 16 and vision["max_images"] == 2
    assert vision["max_image_pixels"] == 20000
    status, show = request_json(str(daemon.socket), "POST", "/api/show", {"model": daemon.model})
    assert "vision" in show["capabilities"]
    status, models = daemon.get("/v1/models")
    assert next(c for c in models["data"] if c["id"] == daemon.model)["vision"] is True
    for face, image, _ in BAD[:3]:
        _ask(daemon, face, image)
    before = daemon.get("/v1/engine/stats")[1]
    for _ in range(2):
        status, out = _ask(daemon, "ollama")
        assert status == 200 and _text("ollama", out) == expected[0]
    status, stats = daemon.get("/v1/engine/stats")
    assert stats["running"] == 0 and stats["kv_blocks_used"] == 0, stats  # (cached blocks are not in use)
    # the tower ran at most once for the picture sent twice (once when no other test sent it before)
    assert stats["images_queued"] == 0 and stats["images_encoded"] - before["images_encoded"] <= 1, stats
    assert stats["image_hits"] - before["image_hits"] >= 1 and stats["image_seconds"] > 0, stats


def test_the_tower_from_an_mmproj_file_gives_the_same_answer(folder, expected, tmp_path):
    """--mmproj: the tower and projector from llama.cpp's mmproj GGUF of the same model (its projection is
    F16 there, as it is in the folder here), not from the folder."""
    mmproj = write_mmproj(folder, tmp_path / "mmproj-tiny.gguf")
    with running_daemon(folder, "--kv-cache-gb", "0.05", "--mmproj", str(mmproj), prefix="mbm-") as d:
        status, health = d.get("/health")
        assert health["vision"]["source"] == "mmproj mmproj-tiny.gguf"
        d.model = health["model"]
        status, out = _ask(d, "openai")
        assert status == 200 and _text("openai", out) == expected[0], out
    bad = tmp_path / "not-mmproj.gguf"
    bad.write_bytes(b"GGUF nonsense")
    with pytest.raises(RuntimeError, match="mmproj not-mmproj.gguf: not an mmproj file"):  # (its model: it stops)
        with running_daemon(folder, "--kv-cache-gb", "0.05", "--mmproj", str(bad), prefix="mbm-"):
            pass

"""make_vision_model.py and bench_vision.py (docs/scripts.md): a tiny random Gemma 3 vision folder under the
hub's tensor names and a tiny SmolVLM one, and the benchmark's phases on its own daemon serving it (llama.cpp's
side only with a llama-server and the converter)."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from tests.scripts.helpers import SCRIPTS, run

pytestmark = pytest.mark.model


def test_make_vision_model(env, tmp_path):
    out = tmp_path / "g3v"
    proc = run(env, SCRIPTS / "dev" / "make_vision_model.py", "--shape", "tiny", "--out", out)
    assert "make_vision_model:" in proc.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma3" and config["mm_tokens_per_image"] == 16
    with safe_open(out / "model.safetensors", "pt") as f:
        names = list(f.keys())
    # the hub's names, which llama.cpp's converter takes for the tower
    assert any(n.startswith("vision_tower.vision_model.encoder.layers.") for n in names)
    assert any(n.startswith("language_model.model.layers.") for n in names)
    assert not any(n.startswith("model.") for n in names)
    tokens = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    assert {"<start_of_image>", "<end_of_image>", "<image_soft_token>"} <= {t["content"] for t in tokens}
    out = tmp_path / "svlm"
    proc = run(env, SCRIPTS / "dev" / "make_vision_model.py", "--shape", "smolvlm-tiny", "--out", out)
    assert "make_vision_model:" in proc.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "idefics3" and config["scale_factor"] == 2
    prep = json.loads((out / "preprocessor_config.json").read_text())
    assert prep["size"] == {"longest_edge": 128} and prep["max_image_size"] == {"longest_edge": 32}
    tokens = {t["content"] for t in json.loads((out / "tokenizer.json").read_text())["added_tokens"]}
    assert {"<fake_token_around_image>", "<image>", "<global-img>", "<row_4_col_4>"} <= tokens


def test_bench_vision(env, tmp_path):
    out = tmp_path / "vision.json"
    args = ["--shape", "tiny", "--cache", tmp_path / "cache", "--clients", "2", "--tokens", "4", "--repeats", "1"]
    args += ["--threads", "1", "--json", out]
    env = {k: v for k, v in env.items() if k != "LLAMA_SERVER"}
    proc = run(env, SCRIPTS / "features" / "bench_vision.py", *args, timeout=600)
    report = json.loads(out.read_text())
    mine = report["minibatch"]
    assert report["image_px"] == 64 and "llama.cpp" not in report
    assert mine["ttft_one_image_s"] > 0 and mine["one_chat"]["tokens_s"] > 0 and mine["2_chats"]["tokens_s"] > 0
    assert mine["text_ttft_alone_s"] > 0 and mine["text_ttft_beside_images_s"] > 0
    assert "| minibatch |" in proc.stdout

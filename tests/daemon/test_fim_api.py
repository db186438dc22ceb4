"""Fill-in-the-middle through the real daemon: `suffix` on OpenAI's /v1/completions and on Ollama's /api/generate
give the model its own markers' prompt (the same ids as the one assembly makes), end at its end markers, and a
model without markers is refused with a 400 naming the field, nothing submitted."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from minibatch.daemon.client import request_json
from minibatch.engine.text.fim import Infill, assemble
from minibatch.engine.text.tokenizer import TextTokenizer

from .helpers import Daemon

# StarCoder's markers, written over four unused special tokens of the built-in vocabulary (which has the
# repository-level ones, <repo_name> and <file_sep>, already)
RENAMED = {"<jupyter_start>": "<fim_prefix>", "<jupyter_text>": "<fim_suffix>", "<jupyter_code>": "<fim_middle>",
           "<jupyter_output>": "<fim_pad>"}  # fmt: skip


def with_fim_markers(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    path = dest / "tokenizer.json"
    tok = json.loads(path.read_text())
    for added in tok["added_tokens"]:
        added["content"] = RENAMED.get(added["content"], added["content"])
    tok["model"]["vocab"] = {RENAMED.get(k, k): v for k, v in tok["model"]["vocab"].items()}
    path.write_text(json.dumps(tok))
    return dest


@pytest.fixture(scope="module")
def fim_daemon(tiny_chat_model_dir, tmp_path_factory):
    model = with_fim_markers(tiny_chat_model_dir, tmp_path_factory.mktemp("fim") / "model")
    d = Path(tempfile.mkdtemp(prefix="mbfim-", dir="/tmp"))
    daemon = Daemon(d / "d.sock", model, "--max-model-len", "512", "--speculative", "off").wait_ready()
    daemon.model = model
    yield daemon
    assert daemon.stop() == 0, daemon.log_text()
    shutil.rmtree(d, ignore_errors=True)


PREFIX = "def add(a, b):\n    return "
SUFFIX = "\n\nprint(add(1, 2))\n"


def post(daemon, path: str, body: dict) -> tuple[int, dict]:
    return request_json(str(daemon.socket), "POST", path, body, timeout=60)


def test_openai_suffix_sends_the_models_own_fill_in_the_middle_prompt(fim_daemon):
    tok = TextTokenizer(fim_daemon.model)
    assert tok.fim is not None and tok.fim.repo == 3 and tok.fim.file_sep == 5
    want = assemble(tok.fim, tok.encode, Infill(PREFIX, SUFFIX), 512, 8, tok.added_bos)
    status, out = post(fim_daemon, "/v1/completions", {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 8})
    assert status == 200, out
    assert out["usage"]["prompt_tokens"] == len(want)
    status, ids = post(fim_daemon, "/tokenize", {"content": tok.decode(want, skip_special_tokens=False)})
    assert status == 200 and ids["tokens"] == want  # the markers are single tokens of the model's own


def test_the_middle_ends_at_the_models_end_markers(fim_daemon):
    pad = TextTokenizer(fim_daemon.model).fim.pad
    body = {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 8, "logit_bias": {str(pad): 100}}
    status, out = post(fim_daemon, "/v1/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == "" and out["usage"]["completion_tokens"] == 1


def test_ollama_generate_with_a_suffix_fills_in_the_middle_even_at_the_start_of_a_file(fim_daemon):
    tok = TextTokenizer(fim_daemon.model)
    want = assemble(tok.fim, tok.encode, Infill("", SUFFIX), 512, 4, tok.added_bos)
    body = {"prompt": "", "suffix": SUFFIX, "stream": False, "options": {"num_predict": 4}}
    status, out = post(fim_daemon, "/api/generate", body)
    assert status == 200, out
    assert out["done"] and out["prompt_eval_count"] == len(want) and out["eval_count"] >= 1


def test_a_suffix_goes_with_one_text_prompt(fim_daemon):
    status, out = post(fim_daemon, "/v1/completions", {"prompt": ["a", "b"], "suffix": "c", "max_tokens": 2})
    assert status == 400 and out["error"]["param"] == "suffix"


def test_a_model_without_markers_is_refused_naming_the_field_and_nothing_runs(tiny_chat_model_dir):
    d = Path(tempfile.mkdtemp(prefix="mbfim-", dir="/tmp"))
    daemon = Daemon(d / "d.sock", tiny_chat_model_dir).wait_ready()
    try:
        before = daemon.stats()["requests_finished"]
        status, out = post(daemon, "/v1/completions", {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 4})
        assert status == 400 and out["error"]["param"] == "suffix"
        assert "no fill-in-the-middle tokens" in out["error"]["message"]
        status, out = post(daemon, "/api/generate", {"prompt": PREFIX, "suffix": SUFFIX, "stream": False})
        assert status == 400 and "suffix" in out["error"] and "fill-in-the-middle" in out["error"]
        stats = daemon.wait_idle()
        assert stats["requests_finished"] == before and stats["kv_blocks_used"] == 0
    finally:
        assert daemon.stop() == 0, daemon.log_text()
        shutil.rmtree(d, ignore_errors=True)

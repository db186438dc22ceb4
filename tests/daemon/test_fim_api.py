"""Fill-in-the-middle through the real daemon: `suffix` on OpenAI's /v1/completions and on Ollama's /api/generate
give the model its own markers' prompt (the same ids as the one assembly makes), end at its end markers, and a
model without markers is refused with a 400 naming the field, nothing submitted."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from minibatch.daemon.client import request_json
from minibatch.engine.text.fim import Infill, assemble
from minibatch.engine.text.tokenizer import TextTokenizer

from .helpers import Daemon, read_sse, session, with_fim_markers

CONTEXT = 4096  # the window (2,048 tokens) and other files' chunks beside it, as an editor's requests fill it


@pytest.fixture(scope="module")
def fim_daemon(tiny_chat_model_dir, tmp_path_factory):
    model = with_fim_markers(tiny_chat_model_dir, tmp_path_factory.mktemp("fim") / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    d = Path(tempfile.mkdtemp(prefix="mbfim-", dir="/tmp"))
    daemon = Daemon(d / "d.sock", model, "--max-model-len", str(CONTEXT), "--speculative", "off").wait_ready()
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
    want = assemble(tok.fim, tok.encode, Infill(PREFIX, SUFFIX), CONTEXT, 8, tok.added_bos)
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
    want = assemble(tok.fim, tok.encode, Infill("", SUFFIX), CONTEXT, 4, tok.added_bos)
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
        name = daemon.get("/health")[1]["model"]
        status, show = post(daemon, "/api/show", {"name": name})  # nothing tells a plugin it takes a suffix
        assert status == 200 and show["template"] == "" and show["capabilities"] == ["completion"]
        # a refused request changes nothing: its keep_alive 0 does not unload the model
        body = {"prompt": PREFIX, "suffix": SUFFIX, "stream": False, "keep_alive": 0}
        status, out = post(daemon, "/api/generate", body)
        assert status == 400 and "fill-in-the-middle" in out["error"]
        body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "stream": False}
        status, out = post(daemon, "/api/chat", body | {"keep_alive": "bad", "options": {"num_predict": 1}})
        assert status == 400 and "keep_alive" in out["error"]
        time.sleep(0.5)  # (an unload would have begun by now)
        status, ps = daemon.get("/api/ps")
        assert status == 200 and [m["model"] for m in ps["models"]] == [f"{name}:latest"], ps
        assert ps["models"][0]["expires_at"].startswith("0001-01-01"), ps  # still kept loaded, as before
    finally:
        assert daemon.stop() == 0, daemon.log_text()
        shutil.rmtree(d, ignore_errors=True)


LLAMA_VSCODE = {  # the request llama.vscode sends at a pause in typing (its fields as its source sends them)
    "input_prefix": "import os\n\ndef add(a, b):\n",
    "input_suffix": "\n\nprint(add(1, 2))\n",
    "input_extra": [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}, {"text": "x = 1\n"}],
    "prompt": "    return ",
    "n_predict": 6,
    "n_indent": 4,
    "top_k": 40,
    "top_p": 0.99,
    "stream": False,
    "samplers": ["top_k", "top_p", "infill"],
    "cache_prompt": True,
    "t_max_prompt_ms": 500,
    "t_max_predict_ms": 1000,
}


def test_infill_answers_llama_vscodes_request_with_the_fields_it_reads(fim_daemon):
    tok = TextTokenizer(fim_daemon.model)
    extra = [("util.py", LLAMA_VSCODE["input_extra"][0]["text"]), ("tmp", "x = 1\n")]
    fill = Infill(LLAMA_VSCODE["input_prefix"], LLAMA_VSCODE["input_suffix"], LLAMA_VSCODE["prompt"], extra)
    want = assemble(tok.fim, tok.encode, fill, CONTEXT, 6, tok.added_bos)
    status, out = post(fim_daemon, "/infill", LLAMA_VSCODE)
    assert status == 200, out
    assert out["tokens_evaluated"] == len(want) and 1 <= out["tokens_predicted"] <= 6
    assert out["stop"] is True and out["stop_type"] in ("eos", "limit") and isinstance(out["content"], str)
    assert out["timings"]["prompt_n"] + out["tokens_cached"] == len(want) and out["timings"]["prompt_ms"] > 0
    again = dict(LLAMA_VSCODE, response_fields=["content", "timings/prompt_n", "tokens_cached"])
    status, cut = post(fim_daemon, "/infill", again)
    assert status == 200 and set(cut) == {"content", "timings/prompt_n", "tokens_cached"}
    assert cut["tokens_cached"] >= len(want) // 16 * 16 - 16  # the same prompt: its blocks are prefix hits


def test_infill_streams_what_it_answers_whole(fim_daemon):
    body = dict(LLAMA_VSCODE, temperature=0, n_predict=8, t_max_predict_ms=None)
    status, whole = post(fim_daemon, "/infill", body)
    assert status == 200, whole

    async def stream():
        async with session(fim_daemon.socket) as s:
            async with s.post("/infill", json={**body, "stream": True}) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                return await read_sse(r)

    events, _ = asyncio.run(stream())
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["tokens_predicted"] == whole["tokens_predicted"]


def test_completion_takes_text_or_token_ids(fim_daemon):
    status, out = post(fim_daemon, "/completion", {"prompt": "Once upon a time", "n_predict": 4, "temperature": 0})
    assert status == 200 and out["tokens_predicted"] == 4 and out["stop_type"] == "limit", out
    ids = TextTokenizer(fim_daemon.model).encode("Once upon a time")
    status, by_ids = post(fim_daemon, "/completion", {"prompt": ids, "n_predict": 4, "temperature": 0})
    assert status == 200 and by_ids["tokens_evaluated"] == len(ids)


def test_t_max_predict_ms_ends_the_answer_at_a_line_break_once_past(fim_daemon):
    newline = TextTokenizer(fim_daemon.model).encode("\n")[0]
    body = {"prompt": "a", "n_predict": 40, "temperature": 0, "logit_bias": [[newline, 100]], "t_max_predict_ms": 0}
    status, out = post(fim_daemon, "/completion", body)
    assert status == 200, out
    assert out["stop_type"] == "limit" and out["tokens_predicted"] < 40 and "\n" in out["content"]
    fim_daemon.wait_idle()  # the request it ended left nothing running


def test_infill_refusals_name_the_field(fim_daemon, tiny_chat_model_dir):
    status, out = post(fim_daemon, "/infill", {"input_prefix": "a", "input_extra": [{"text": 5}]})
    assert status == 400 and out["error"]["param"] == "input_extra.0.text"
    status, out = post(fim_daemon, "/infill", {"input_prefix": "a", "prompt": [1, 2]})
    assert status == 400 and out["error"]["param"] == "prompt"
    status, out = post(fim_daemon, "/completion", {"prompt": ""})
    assert status == 400 and out["error"]["param"] == "prompt"


def aborted(daemon) -> int:
    """Requests the daemon ended because their client went away (its /metrics' count)."""
    found = re.search(r'minibatch_requests_total\{[^}]*finish_reason="abort"[^}]*\} (\S+)', daemon.metrics())
    return int(float(found.group(1))) if found else 0


def test_an_infill_stream_the_editor_drops_is_aborted_and_frees_its_blocks(fim_daemon):
    before = aborted(fim_daemon)

    async def drop():
        async with session(fim_daemon.socket) as s:
            body = {**LLAMA_VSCODE, "stream": True, "n_predict": 900, "ignore_eos": True, "n_indent": 0}
            async with s.post("/infill", json=body) as r:
                await r.content.readline()  # the first event, then the editor moves on

    asyncio.run(drop())
    stats = fim_daemon.wait_idle(timeout=1.0)  # 900 tokens left decoding would hold the engine for seconds
    assert stats["running"] == 0 and stats["kv_blocks_used"] == 0
    assert aborted(fim_daemon) == before + 1


def test_an_infill_the_editor_drops_before_its_first_token_is_aborted(fim_daemon):
    """The next keystroke closes the request while its prompt is still being read (a whole answer, as
    llama.vim and llama.vscode ask): aborted, nothing left running or held."""
    before = aborted(fim_daemon)
    long = "".join(f"value_{i} = compute({i})\n" for i in range(150))  # ~1,500 prompt tokens

    async def drop():
        async with session(fim_daemon.socket) as s:
            body = {**LLAMA_VSCODE, "input_prefix": long, "n_predict": 900, "ignore_eos": True, "n_indent": 0}
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(s.post("/infill", json=body), timeout=0.02)

    asyncio.run(drop())
    stats = fim_daemon.wait_idle(timeout=1.0)
    assert stats["running"] == 0 and stats["kv_blocks_used"] == 0
    assert aborted(fim_daemon) == before + 1


CHUNKS = [{"text": "def sub(a, b):\n    return a - b\n" * 12, "time": [1733, 52000], "filename": "util.py"}]
LLAMA_VIM_WARM = {  # what llama.vim sends as it gathers chunks, so that they are in the cache for the next request
    "input_prefix": "",
    "input_suffix": "",
    "input_extra": CHUNKS,
    "prompt": "",
    "n_predict": 0,
    "temperature": 0.0,
    "stream": False,
    "samplers": [],
    "cache_prompt": True,
    "t_max_prompt_ms": 1,
    "t_max_predict_ms": 1,
    "response_fields": [""],
}
LLAMA_VIM = {  # and at a pause in typing
    "input_prefix": "import os\n\ndef add(a, b):\n",
    "input_suffix": "\n\nprint(add(1, 2))\n",
    "input_extra": CHUNKS,
    "prompt": "    return ",
    "n_predict": 8,
    "n_indent": 4,
    "top_k": 40,
    "top_p": 0.90,
    "stream": False,
    "samplers": ["top_k", "top_p", "infill"],
    "cache_prompt": True,
    "t_max_prompt_ms": 500,
    "t_max_predict_ms": 250,
    "response_fields": [
        "content",
        "timings/prompt_n",
        "timings/prompt_ms",
        "timings/prompt_per_token_ms",
        "timings/prompt_per_second",
        "timings/predicted_n",
        "timings/predicted_ms",
        "timings/predicted_per_token_ms",
        "timings/predicted_per_second",
        "truncated",
        "tokens_cached",
    ],
}


def test_llama_vims_warm_up_puts_its_chunks_in_the_cache_and_answers_nothing(fim_daemon):
    tok = TextTokenizer(fim_daemon.model)
    extra = [(c["filename"], c["text"]) for c in CHUNKS]
    warm_ids = assemble(tok.fim, tok.encode, Infill("", "", "", extra), CONTEXT, 1, tok.added_bos)
    chunk_part = warm_ids.index(tok.fim.prefix) - (tok.added_bos is not None)
    assert chunk_part > 100  # the chunks are in the prompt (the context leaves them room)
    status, out = post(fim_daemon, "/infill", LLAMA_VIM_WARM)
    assert status == 200 and out == {}, out  # response_fields [""]: nothing asked for
    status, out = post(fim_daemon, "/infill", {**LLAMA_VIM_WARM, "response_fields": None})
    assert status == 200 and out["content"] == "" and out["tokens_predicted"] == 0, out
    assert out["tokens_evaluated"] == len(warm_ids) and out["stop_type"] == "limit"

    async def streamed():
        async with session(fim_daemon.socket) as s:
            async with s.post("/infill", json={**LLAMA_VIM_WARM, "stream": True, "response_fields": None}) as r:
                return await read_sse(r)

    events, _ = asyncio.run(streamed())
    assert len(events) == 1 and events[0]["stop"] is True and events[0]["content"] == ""
    # the completion that follows finds the chunks computed
    status, out = post(fim_daemon, "/infill", LLAMA_VIM)
    assert status == 200, out
    assert set(out) <= set(LLAMA_VIM["response_fields"]) and {"content", "tokens_cached", "truncated"} <= set(out)
    assert out["tokens_cached"] >= chunk_part // 16 * 16 and out["truncated"] is False
    fill = Infill(LLAMA_VIM["input_prefix"], LLAMA_VIM["input_suffix"], LLAMA_VIM["prompt"], extra)
    want = assemble(tok.fim, tok.encode, fill, CONTEXT, 8, tok.added_bos)
    assert out["timings/prompt_n"] + out["tokens_cached"] == len(want)


def test_continue_finds_the_suffix_in_api_show_and_streams_a_middle_over_ollama(fim_daemon):
    """Continue's Ollama provider fills in the middle only when /api/show's template holds `.Suffix`; then it
    streams /api/generate with `suffix` and reads each line's `response`."""
    tok = TextTokenizer(fim_daemon.model)
    status, show = post(fim_daemon, "/api/show", {"name": "model"})
    assert status == 200 and ".Suffix" in show["template"] and "insert" in show["capabilities"]
    assert "<fim_prefix>" in show["template"] and "<fim_middle>" in show["template"]  # its own markers
    body = {  # as Continue sends it (its option fields, those it leaves unset dropped by JSON.stringify)
        "model": "model",
        "prompt": PREFIX,
        "suffix": SUFFIX,
        "options": {
            "temperature": 0.01,
            "top_p": 0.9,
            "top_k": 40,
            "num_predict": 6,
            "stop": ["\n\n"],
            "num_ctx": 8192,
        },
        "keep_alive": 1800,
        "stream": True,
    }

    async def stream():
        async with session(fim_daemon.socket) as s:
            async with s.post("/api/generate", json=body) as r:
                assert r.status == 200
                return [json.loads(line) for line in (await r.text()).splitlines() if line.strip()]

    lines = asyncio.run(stream())
    assert all("response" in line for line in lines) and lines[-1]["done"] is True
    want = assemble(tok.fim, tok.encode, Infill(PREFIX, SUFFIX), CONTEXT, 6, tok.added_bos)
    assert lines[-1]["prompt_eval_count"] == len(want) and 1 <= lines[-1]["eval_count"] <= 6


def test_minuets_openai_completion_with_a_suffix_streams_a_middle(fim_daemon):
    """minuet's `openai_fim_compatible` provider: /v1/completions with `suffix`, streamed."""
    tok = TextTokenizer(fim_daemon.model)
    body = {"model": "model", "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 6, "top_p": 0.9, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip

    async def stream():
        async with session(fim_daemon.socket) as s:
            async with s.post("/v1/completions", json=body) as r:
                assert r.status == 200
                return await read_sse(r)

    events, _ = asyncio.run(stream())
    chunks = [e for e in events if isinstance(e, dict)]
    assert any(c["choices"] and "text" in c["choices"][0] for c in chunks)
    want = assemble(tok.fim, tok.encode, Infill(PREFIX, SUFFIX), CONTEXT, 6, tok.added_bos)
    assert chunks[-1]["usage"]["prompt_tokens"] == len(want)


def test_an_editor_moving_down_the_file_reuses_the_last_prompts_keys_at_their_new_places(fim_daemon):
    lines = [f"value_{i} = compute({i})\n" for i in range(80)]

    def at(line: int, typed: str) -> dict:
        before, after = "".join(lines[line - 36 : line]), "\n" + "".join(lines[line + 1 : line + 6])
        return {"input_prefix": before, "input_suffix": after, "prompt": typed, "n_predict": 2, "ignore_eos": True}

    before = fim_daemon.wait_idle()["reused_tokens"]
    status, first = post(fim_daemon, "/infill", at(40, "value_"))
    assert status == 200, first
    status, moved = post(fim_daemon, "/infill", at(44, "value_"))  # the window slid four lines down
    assert status == 200, moved
    # the 32 lines both windows hold (over 256 tokens: --cache-reuse's default) are taken from the first prompt,
    # four lines' tokens up, not computed
    assert moved["tokens_cached"] >= 256 and moved["timings"]["prompt_n"] < moved["tokens_evaluated"] // 2
    status, typed = post(fim_daemon, "/infill", at(44, "value_44 = "))  # a word typed at the cursor
    assert status == 200 and typed["tokens_cached"] >= moved["tokens_cached"], typed  # all before it held
    stats = fim_daemon.wait_idle()
    # (the moved window's first block differs from the first one's: all it holds it took at shifted places)
    assert stats["reused_tokens"] - before >= moved["tokens_cached"]
    assert stats["kv_blocks_used"] == 0  # nothing held once idle: the copies' source blocks are let go
    # a request that is not a middle to fill never takes shifted rows
    status, plain = post(fim_daemon, "/completion", {"prompt": "".join(lines[8:44]), "n_predict": 2})
    assert status == 200 and fim_daemon.wait_idle()["reused_tokens"] == stats["reused_tokens"]


def test_n_indent_ends_the_answer_before_a_line_indented_less():
    from minibatch.daemon.api.llama import _dedent

    body = "x = 1\n        y = 2\n    return y\n"
    assert _dedent(body, 8) == len("x = 1\n        y = 2\n    ")  # cut after the short line's spaces
    assert _dedent(body, 4) is None and _dedent(body, 0) is None
    assert _dedent("a\n\n        b\n", 8) is None  # an empty line is no dedent
    assert _dedent("first line only", 8) is None  # (the first line is the cursor's own)


def test_n_indent_out_of_range_is_refused_naming_it(fim_daemon):
    status, out = post(fim_daemon, "/infill", {**LLAMA_VSCODE, "n_indent": -1})
    assert status == 400 and out["error"]["param"] == "n_indent"


def test_too_long_an_answer_is_refused_in_the_fields_own_name(fim_daemon):
    """The param and the message name the same field, each face's own word for the answer's length."""
    status, out = post(fim_daemon, "/completion", {"prompt": "a", "n_predict": CONTEXT})
    assert status == 400 and out["error"]["param"] == "n_predict", out
    assert "n_predict (4096)" in out["error"]["message"] and "max_tokens" not in out["error"]["message"], out
    body = {"prompt": "a", "stream": False, "raw": True, "options": {"num_predict": CONTEXT}}
    status, out = post(fim_daemon, "/api/generate", body)
    assert status == 400 and "num_predict (4096)" in out["error"] and "max_tokens" not in out["error"], out
    status, out = post(fim_daemon, "/v1/completions", {"prompt": "a", "max_tokens": CONTEXT})
    assert status == 400 and out["error"]["param"] == "max_tokens" and "max_tokens (4096)" in out["error"]["message"]


def test_fill_in_the_middle_texts_are_bounded_by_bytes_naming_each_field(fim_daemon):
    """A text that could not fit the context whatever it encodes to is refused from its bytes alone, named as
    the client wrote it; a long one within the bound is cut to the window before it is encoded, and answered."""
    bound = CONTEXT * TextTokenizer(fim_daemon.model).max_token_bytes
    long = "x = 1\n" * (bound // 6 + 1)
    for path, body, field in (
        ("/infill", {"input_prefix": long}, "input_prefix"),
        ("/infill", {"input_suffix": long}, "input_suffix"),
        ("/infill", {"prompt": long}, "prompt"),
        ("/infill", {"input_extra": [{"text": "a"}, {"text": long}]}, "input_extra.1.text"),
        ("/v1/completions", {"prompt": long, "suffix": "b"}, "prompt"),
        ("/v1/completions", {"prompt": "a", "suffix": long}, "suffix"),
    ):
        status, out = post(fim_daemon, path, {**body, "n_predict" if path == "/infill" else "max_tokens": 2})
        assert status == 400 and out["error"]["param"] == field, (path, field, out)
        assert out["error"]["message"].startswith(f"{field}: the text is {len(long)} bytes"), out
    status, out = post(fim_daemon, "/api/generate", {"prompt": "a", "suffix": long, "stream": False})
    assert status == 400 and out["error"].startswith("suffix: the text is"), out
    within = long[: bound // 2]
    body = {"input_prefix": within, "input_suffix": within, "input_extra": [{"text": within}], "n_predict": 2}
    status, out = post(fim_daemon, "/infill", body)
    assert status == 200 and out["tokens_evaluated"] < CONTEXT, out
    fim_daemon.wait_idle()

"""Several models from one daemon: loaded by name on first use, each its own engine, kept alive, evicted,
unloaded — the real daemon over its socket, with the openai SDK and the ollama client."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import ollama
import openai
import pytest

from tests.conftest import TINY_COMMON, TOKENIZER_FILES

from .helpers import Daemon, chat_body, session


@pytest.fixture(scope="module")
def qwen_chat_dir(tmp_path_factory, builtin_model_dir) -> Path:
    """A tiny random Qwen2 (another family than the daemon's own model) with the built-in tokenizer."""
    import torch
    import transformers

    path = tmp_path_factory.mktemp("tiny-qwen-chat")
    torch.manual_seed(3)
    cfg = transformers.Qwen2Config(**{**TINY_COMMON, "vocab_size": 49152}, tie_word_embeddings=True)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (builtin_model_dir / name).exists():
            shutil.copy(builtin_model_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def corrupt_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corrupt") / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    return path


@pytest.fixture(scope="module")
def models_env(tmp_path_factory, qwen_chat_dir, corrupt_gguf) -> dict:
    """A models folder holding the Qwen model as `qwen` and the corrupt file as `broken`: a request names
    models by what the catalog lists, never by a path."""
    folder = tmp_path_factory.mktemp("models-folder")
    shutil.copytree(qwen_chat_dir, folder / "qwen")
    shutil.copy(corrupt_gguf, folder / "broken.gguf")
    return {"MINIBATCH_MODELS_DIR": str(folder)}


@pytest.fixture(scope="module")
def daemon(tiny_chat_model_dir, models_env):
    d = tempfile.mkdtemp(prefix="mb-models-", dir="/tmp")
    daemon = Daemon(
        Path(d) / "d.sock", tiny_chat_model_dir, "--max-num-seqs", "8", "--kv-cache-gb", "0.05", env=models_env
    )
    daemon.wait_ready()
    yield daemon
    assert daemon.stop() == 0, daemon.log_text()
    shutil.rmtree(d, ignore_errors=True)


def sdk(daemon) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://localhost/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.socket)), timeout=120),
    )


def ollama_client(daemon) -> ollama.Client:
    return ollama.Client(host="http://localhost", transport=httpx.HTTPTransport(uds=str(daemon.socket)))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def greedy(client: openai.OpenAI, model: str, text: str = "Tell me about cats.") -> str:
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=12, temperature=0
    )
    assert out.model == model
    return out.choices[0].message.content


def test_models_answer_by_name_in_turn_and_at_once(daemon, tiny_chat_model_dir):
    own, builtin, qwen = tiny_chat_model_dir.name, "smollm2-135m-instruct", "qwen"  # the daemon's by its name
    client = sdk(daemon)
    first = greedy(client, own)
    second = greedy(client, builtin)  # loads the built-in model by its alias: the request waits for it
    third = greedy(client, qwen)  # and a model of another family, by its name in the models folder
    assert second != first and len(second.split()) >= 3  # the real model speaks; the tiny random one cannot
    assert [greedy(client, m) for m in (own, builtin, qwen)] == [first, second, third]  # reused, not reloaded
    _, health = daemon.get("/health")
    facts = {m["name"]: m["family"] for m in health["models"]}
    assert facts == {own: "llama", builtin: "llama", qwen: "qwen2"}
    assert health["model"] == own  # the top level stays the daemon's own
    assert daemon.log_text().count("ready in") == 3  # one load each

    # At once, from both APIs: each answer is its model's, whatever the other engines are doing.
    oc = ollama_client(daemon)

    def ollama_answer(model: str) -> str:
        r = oc.chat(
            model=model,
            messages=[{"role": "user", "content": "Tell me about cats."}],
            options={"temperature": 0, "num_predict": 12, "repeat_penalty": 1.0},  # the SDK's sampling
        )
        assert r.model == model
        return r.message.content

    async def together():
        loop = asyncio.get_running_loop()
        jobs = [loop.run_in_executor(None, greedy, client, m) for m in (own, builtin, qwen) * 2]
        jobs += [loop.run_in_executor(None, ollama_answer, m) for m in (own, builtin, qwen)]
        return await asyncio.gather(*jobs)

    answers = asyncio.run(together())
    assert answers == [first, second, third] * 3
    listed = {m.model for m in oc.ps().models}
    assert listed == {f"{own}:latest", f"{builtin}:latest", f"{qwen}:latest"}


def test_ps_tags_and_keep_alive(daemon, tiny_chat_model_dir):
    own, other = tiny_chat_model_dir.name, "qwen"
    oc = ollama_client(daemon)
    oc.generate(model=other, prompt="Hi", options={"num_predict": 2}, keep_alive="10m")
    ps = {m.model: m for m in oc.ps().models}
    assert str(ps[f"{own}:latest"].expires_at).startswith("0001-01-01")  # the daemon's own stays
    left = ps[f"{other}:latest"].expires_at.timestamp() - time.time()
    assert 590 < left <= 600, left  # this request's keep_alive
    assert ps[f"{other}:latest"].size > 0 and ps[f"{other}:latest"].details.family == "qwen2"
    tags = [m.model for m in oc.list().models]
    assert tags[0] == f"{own}:latest" and f"{other}:latest" in tags and "smollm2-135m-instruct:latest" in tags
    assert len(tags) == len(set(tags))  # a loaded model is listed once

    # Ollama's empty requests: keep_alive 0 unloads, an empty generate loads again.
    r = oc.generate(model=other, keep_alive=0)
    assert r.done_reason == "unload"
    assert f"{other}:latest" not in [m.model for m in oc.ps().models]
    r = oc.generate(model=other)
    assert r.done_reason == "load" and other in [m["name"] for m in daemon.get("/health")[1]["models"]]

    # per model engine endpoints
    status, stats = daemon.get(f"/v1/engine/stats?steps=0&model={other}")
    assert status == 200 and stats["model"] == other
    status, stats = daemon.get("/v1/engine/stats?steps=0")
    assert status == 200 and stats["model"] == own and {own, other} <= set(stats["models"])
    assert stats["totals"]["kv_blocks_total"] == sum(m["kv_blocks_total"] for m in stats["models"].values())
    status, err = daemon.get("/v1/engine/steps?model=nobody")
    assert status == 404 and err["error"]["param"] == "model" and "not loaded" in err["error"]["message"]


def test_streaming_load_shows_its_status_and_bad_names_say_what_there_is(daemon):
    async def go():
        async with session(daemon.socket) as s:
            async with s.post("/api/generate", json={"model": "qwen", "keep_alive": 0}) as r:
                assert (await r.json())["done_reason"] == "unload"
            async with s.post("/api/generate", json={"model": "qwen"}) as r:  # streams by default
                lines = [line for line in (await r.text()).splitlines() if line]
            async with s.post("/v1/chat/completions", json=chat_body(model="no-such-model")) as r:
                missing = r.status, await r.json()
            async with s.post("/v1/chat/completions", json=chat_body(model="broken")) as r:
                broken = r.status, await r.json()
            async with s.post("/api/chat", json={**chat_body(model="broken"), "stream": False}) as r:
                broken_ollama = r.status, await r.json()
            async with s.post("/v1/chat/completions", json=chat_body(max_tokens=3)) as r:
                still = r.status
            return lines, missing, broken, broken_ollama, still

    lines, missing, broken, broken_ollama, still = asyncio.run(go())
    import json

    assert json.loads(lines[0])["status"] == "loading" and json.loads(lines[-1])["done_reason"] == "load"
    status, err = missing
    assert status == 404 and err["error"]["param"] == "model" and "smollm2-135m-instruct" in err["error"]["message"]
    status, err = broken
    assert status == 500 and err["error"]["code"] == "model_load_failed" and "'broken'" in err["error"]["message"]
    assert "/" not in err["error"]["message"]  # what is wrong with the file, and where it is, is in the log
    assert broken_ollama[0] == 500 and "could not be loaded" in broken_ollama[1]["error"]
    assert still == 200  # every other model keeps serving
    _, health = daemon.get("/health")
    assert health["status"] == "ok" and any("broken" in k for k in health["load_errors"])


def test_sixteen_requests_over_two_models_leak_no_block(daemon, tiny_chat_model_dir):
    names = [tiny_chat_model_dir.name, "qwen"]

    async def one(s, i):
        body = chat_body(f"Count to {i}.", model=names[i % 2], max_tokens=8 + i, ignore_eos=True, stream=i % 3 == 0)
        async with s.post("/v1/chat/completions", json=body) as r:
            await r.read()
            return r.status

    async def go():
        async with session(daemon.socket) as s:
            return await asyncio.gather(*(one(s, i) for i in range(16)))

    assert asyncio.run(go()) == [200] * 16
    deadline = time.monotonic() + 30
    for name in names:
        while True:
            _, st = daemon.get(f"/v1/engine/stats?steps=0&model={name}")
            if st["running"] == st["waiting"] == st["kv_blocks_used"] == 0:
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.05)
        assert st["requests_finished"] >= 8


def test_the_least_recently_used_idle_model_is_evicted_never_a_busy_one(tiny_chat_model_dir, models_env):
    own, other = tiny_chat_model_dir.name, "qwen"
    d = tempfile.mkdtemp(prefix="mb-evict-", dir="/tmp")
    daemon = Daemon(
        Path(d) / "d.sock",
        tiny_chat_model_dir,  # the operator's path; requests name it by its folder's name
        "--max-loaded-models",
        "1",
        "--load-wait",
        "0.25",
        "--kv-cache-gb",
        "0.05",
        env=models_env,
    ).wait_ready()  # the wait is well inside the busy request's 400 tokens (about 0.5 s on this tiny model)
    try:
        client = sdk(daemon)
        greedy(client, other)  # evicts the idle own model
        assert [m["name"] for m in daemon.get("/health")[1]["models"]] == [other]

        async def go():
            async with session(daemon.socket) as s:
                long = asyncio.ensure_future(
                    s.post("/v1/chat/completions", json=chat_body(model=other, max_tokens=400, ignore_eos=True))
                )
                while daemon.get(f"/v1/engine/stats?steps=0&model={other}")[1]["running"] == 0:
                    await asyncio.sleep(0.02)
                async with s.post("/v1/chat/completions", json=chat_body(model=own, max_tokens=2)) as r:
                    refused = r.status, await r.json()
                r = await long
                assert r.status == 200
                await r.read()
                async with s.post("/v1/chat/completions", json=chat_body(model=own, max_tokens=2)) as r:
                    return refused, r.status

        (status, err), after = asyncio.run(go())
        assert status == 503 and err["error"]["code"] == "no_room" and other in err["error"]["message"]
        assert after == 200  # once the busy model is idle it is evicted in turn
        assert [m["name"] for m in daemon.get("/health")[1]["models"]] == [own]
        assert "unloaded" in daemon.log_text() and "to make room for" in daemon.log_text()
    finally:
        assert daemon.stop() == 0, daemon.log_text()
        shutil.rmtree(d, ignore_errors=True)


def test_keep_alive_zero_returns_the_memory(tiny_chat_model_dir):
    """The built-in model (about 100 MB of weights) loaded by a request and unloaded after it: the daemon's
    RSS comes back, within a second, to within 25% of what the load added."""
    d = tempfile.mkdtemp(prefix="mb-rss-", dir="/tmp")
    daemon = Daemon(Path(d) / "d.sock", tiny_chat_model_dir, "--kv-cache-gb", "0.05").wait_ready()
    try:
        oc = ollama_client(daemon)
        oc.generate(model=str(tiny_chat_model_dir), prompt="Hi", options={"num_predict": 2})
        before = rss_mb(daemon.pid)
        oc.generate(model="smollm2-135m-instruct", prompt="Hi", options={"num_predict": 4})
        loaded = rss_mb(daemon.pid)
        r = oc.generate(model="smollm2-135m-instruct", keep_alive=0)
        assert r.done_reason == "unload"
        assert loaded - before > 50, (before, loaded)
        deadline = time.monotonic() + 5  # freed within a second, once the request's frames are gone
        while (after := rss_mb(daemon.pid)) - before >= 0.25 * (loaded - before) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert after - before < 0.25 * (loaded - before), (before, loaded, after)
        while "memory returned" not in daemon.log_text() and time.monotonic() < deadline + 2:
            time.sleep(0.1)  # the pool's next tick logs what it gave back
        assert "memory returned" in daemon.log_text()
    finally:
        assert daemon.stop() == 0, daemon.log_text()
        shutil.rmtree(d, ignore_errors=True)


def test_each_model_takes_its_own_settings_and_a_bad_one_fails_that_model_alone(tiny_chat_model_dir, models_env):
    """--model-settings: the daemon's own model keeps its cache in bf16, the Qwen model is set to q8_0, which its
    16-value heads cannot hold: loading it fails naming the option and why, and the first model keeps serving.
    /health and /api/ps show each model's cache."""
    import json

    d = Path(tempfile.mkdtemp(prefix="mb-settings-", dir="/tmp"))
    settings = d / "models.json"
    own = tiny_chat_model_dir.name
    settings.write_text(json.dumps({own: {"kv-cache-type": "bf16"}, "qwen": {"kv_cache_type": "q8_0"}}))
    daemon = Daemon(d / "d.sock", tiny_chat_model_dir, "--kv-cache-gb", "0.05", "--model-settings", str(settings),
                    env=models_env)  # fmt: skip
    try:
        daemon.wait_ready()

        async def go():
            async with session(daemon.socket) as s:
                async with s.post("/v1/chat/completions", json=chat_body(model="qwen")) as r:
                    bad = r.status, await r.json()
                async with s.post("/v1/chat/completions", json=chat_body(max_tokens=3)) as r:
                    still = r.status
                async with s.get("/api/ps") as r:
                    ps = await r.json()
            return bad, still, ps

        bad, still, ps = asyncio.run(go())
        status, err = bad
        assert status == 500 and err["error"]["code"] == "model_load_failed", err
        assert "kv_cache_type q8_0: q8_0 needs head_dim a multiple of 32" in err["error"]["message"], err
        assert still == 200
        _, health = daemon.get("/health")
        (mine,) = health["models"]
        assert mine["kv_cache_type"] == "bf16" and mine["kv_bytes_per_token"] == 2 * 2 * 16 * 2 * 2
        assert "q8_0 needs head_dim" in health["load_errors"]["qwen"]
        (running,) = ps["models"]
        assert running["kv_cache_type"] == "bf16" and running["kv_cache_tokens"] == mine["kv_cache_tokens"] > 0
    finally:
        assert daemon.stop() == 0, daemon.log_text()
        shutil.rmtree(d, ignore_errors=True)


def test_model_settings_with_an_unknown_option_refuse_the_start(tiny_chat_model_dir, short_tmp):
    import json
    import subprocess
    import sys

    settings = short_tmp / "models.json"
    settings.write_text(json.dumps({"qwen": {"threads": 4}}))
    out = subprocess.run(
        [sys.executable, "-m", "minibatch.daemon.cli", "start", "--socket", str(short_tmp / "d.sock"), "--model",
         str(tiny_chat_model_dir), "--model-settings", str(settings)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and "'qwen': 'threads' is not a per-model option; they are kv-cache-type" in out.stderr


BAD_SETTINGS = [  # (the file's bytes, what the refusal names besides the option and the file)
    (b'\xff\xfe{"m": {}}', "not UTF-8 text (byte 0 is 0xff)"),
    (b"[" * 100_000, "nested too deeply"),
    (b'{"m": {"max-num-seqs": "many"}}', "'m': max-num-seqs: must be an integer, got 'many'"),
    (b'{"m": {"max-num-seqs": 1e400}}', "'m': max-num-seqs: must be an integer, got inf"),
    (b'{"m": {"max-num-seqs": 2.5}}', "'m': max-num-seqs: must be an integer, got 2.5"),
    (b'{"m": {"max-num-seqs": true}}', "'m': max-num-seqs: must be an integer, got True"),
    (b'{"m": {"max-num-seqs": null}}', "'m': max-num-seqs: must be an integer, got None"),
    (b'{"m": {"kv-cache-gb": NaN}}', "NaN is not a JSON number"),
    (b'{"m": {"kv-cache-gb": 1e400}}', "'m': kv-cache-gb: must be a finite number, got inf"),
    (b'{"m": {"kv-cache-gb": [1]}}', "'m': kv-cache-gb: must be a finite number, got [1]"),
    (b'{"m": {"max-num-seqs": 0}}', "'m': max_num_seqs must be at least 1, got 0"),
    (b'{"m": {"max-num-seqs": 600, "max-num-batched-tokens": 64}}', "max_num_batched_tokens (64) must be >="),
    (b'{"m": {"kv-cache-gb": -1}}', "'m': kv_cache_gb must be positive, got -1.0"),
    (b'{"m": 5}', "an object of model names, each an object of options"),
    (b'{"m": {', "not JSON: Expecting property name"),
]


@pytest.mark.parametrize(("content", "said"), BAD_SETTINGS)
def test_a_bad_model_settings_file_is_refused_naming_the_option_the_file_and_the_setting(tmp_path, content, said):
    from minibatch.daemon.models.settings import read_model_settings
    from minibatch.engine.factory import EngineConfig

    path = tmp_path / "models.json"
    path.write_bytes(content)
    with pytest.raises(ValueError) as err:
        read_model_settings(str(path), EngineConfig())
    assert str(err.value).startswith(f"--model-settings {path}: ") and said in str(err.value), str(err.value)


def test_model_settings_read_as_their_flags_take_them(tmp_path):
    from minibatch.daemon.models.settings import read_model_settings
    from minibatch.engine.factory import EngineConfig

    path = tmp_path / "models.json"
    path.write_text('{"m": {"max-model-len": null, "block-size": "32", "kv_cache_gb": 1, "kv-cache-type": "q8_0"}}')
    assert read_model_settings(str(path), EngineConfig()) == {
        "m": {"max_model_len": None, "block_size": 32, "kv_cache_gb": 1.0, "kv_cache_type": "q8_0"}
    }


def test_a_model_settings_file_nested_past_the_parser_prints_no_traceback(short_tmp):
    import subprocess
    import sys

    settings = short_tmp / "models.json"
    settings.write_text("[" * 100_000)
    out = subprocess.run(
        [sys.executable, "-m", "minibatch.daemon.cli", "start", "--socket", str(short_tmp / "d.sock"),
         "--model-settings", str(settings)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr == f"minibatchd: --model-settings {settings}: not JSON this daemon reads: nested too deeply\n"

"""LoRA adapters on demand through the real daemon: at most --max-loras resident, the least recently used one
no request holds let go for the next one named, a request for another waiting while every resident one is
held; a --lora-dir's adapters served by the names it holds, one that does not fit refused naming it, and the
daemon serving on."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from minibatch.daemon.client import request_json
from tests.conftest import make_lora

from .helpers import running_daemon, session

pytest.importorskip("peft")

N = 8


@pytest.fixture(scope="module")
def folders(tiny_chat_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    named = {
        n: make_lora(tiny_chat_model_dir, root / n, ["q_proj", "v_proj", "down_proj"], 8, 16, False, seed)
        for n, seed in (("a", 11), ("b", 12))
    }
    shelf = root / "shelf"  # --lora-dir
    make_lora(tiny_chat_model_dir, shelf / "c", ["o_proj", "up_proj"], 4, 8, False, 13)
    broken = shelf / "broken"  # its config, without its weights
    broken.mkdir()
    shutil.copy(shelf / "c" / "adapter_config.json", broken)
    (shelf / "notes.txt").write_text("not an adapter")
    return named, shelf


@pytest.fixture(scope="module")
def daemon(tiny_chat_model_dir, folders):
    named, shelf = folders
    loras = ",".join(f"{n}={p}" for n, p in named.items())
    args = ("--lora", loras, "--max-loras", "1", "--lora-dir", str(shelf), "--kv-cache-gb", "0.05")
    with running_daemon(tiny_chat_model_dir, *args, prefix="mbr-") as d:
        yield d


def _complete(daemon, body: dict) -> tuple[int, dict]:
    ask = {"prompt": "Once upon a time", "n_predict": N, "temperature": 0, **body}
    return request_json(str(daemon.socket), "POST", "/completion", ask, timeout=60)


def _answer(daemon, model: str) -> str:
    status, out = _complete(daemon, {"model": model})
    assert status == 200, out
    return out["content"]


def _resident(daemon) -> list[str]:
    status, health = daemon.get("/health")
    assert status == 200
    return [r["name"] for r in health["loras_resident"]]


def test_one_resident_at_a_time_each_read_again_answers_as_before(daemon, tiny_chat_model_dir):
    status, health = daemon.get("/health")
    assert health["loras"][:2] == ["a", "b"] and _resident(daemon) == ["a"]  # --lora's first, at the start
    one = health["lora_bytes"]
    assert one > 0 and health["loras_resident"][0]["size"] > 0
    base = _answer(daemon, tiny_chat_model_dir.name)
    first = {n: _answer(daemon, n) for n in ("a", "b", "c")}
    assert len({base, *first.values()}) == 4, first  # each its own answer
    assert _resident(daemon) == ["c"]  # (c read from the folder in b's place, b in a's)
    again = {n: _answer(daemon, n) for n in ("b", "a", "c")}
    assert again == first
    status, health = daemon.get("/health")
    assert health["loras"][:3] == ["a", "b", "c"] and health["lora_bytes"] < 2 * one  # one resident, not three
    status, ps = daemon.get("/api/ps")
    assert [r["name"] for r in ps["models"][0]["loras"]] == ["c"]
    # llama-server's ids: places in the names (c added when first named); two at once need two resident
    assert _complete(daemon, {"lora": [{"id": 2, "scale": 1.0}]})[1]["content"] == first["c"]
    status, err = _complete(daemon, {"lora": [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 1.0}]})
    assert status == 400 and err["error"]["param"] == "lora" and "--max-loras" in err["error"]["message"], err
    daemon.wait_idle()


def test_a_request_for_another_adapter_waits_while_the_resident_one_runs(daemon):
    alone = _answer(daemon, "b")
    _answer(daemon, "a")  # a resident

    async def go() -> tuple[str, str, list[str], bool]:
        async with session(daemon.socket) as s:
            body = {"model": "a", "prompt": "Once", "n_predict": 900, "ignore_eos": True, "stream": True}
            async with s.post("/completion", json=body) as long:
                assert long.status == 200
                await long.content.readline()  # a's row is running
                other = asyncio.ensure_future(
                    s.post(
                        "/completion",
                        json={"model": "b", "prompt": "Once upon a time", "n_predict": N, "temperature": 0},
                    )
                )
                await asyncio.sleep(0.3)
                stats = daemon.stats()  # a still runs, b is not in the engine: it waits for a place
                during = _resident(daemon) if (stats["running"], stats["waiting"]) == (1, 0) else ["a is done"]
                waited = not other.done()
                text = (await long.read()).decode()
            resp = await other
            assert resp.status == 200
            return text, (await resp.json())["content"], during, waited

    text, b, during, waited = asyncio.run(go())
    pieces = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    assert pieces and pieces[-1]["stop"] and pieces[-1]["tokens_predicted"] == 900
    assert during == ["a"] and waited  # b is not read over a row that runs under a
    assert b == alone and _resident(daemon) == ["b"]
    daemon.wait_idle()


def test_the_folders_adapters_are_listed_and_only_its_names_are_served(daemon, tiny_chat_model_dir):
    status, models = daemon.get("/v1/models")
    cards = {m["id"]: m for m in models["data"]}
    assert cards["c"]["parent"] == cards["broken"]["parent"] == tiny_chat_model_dir.name
    assert "notes" not in cards and "notes.txt" not in cards
    for name in ("../shelf/c", "shelf/c", "nope"):
        status, err = _complete(daemon, {"model": name})
        assert status == 404 and err["error"]["param"] == "model", (name, err)
        assert "/tmp" not in err["error"]["message"]


def test_an_adapter_that_does_not_fit_is_refused_naming_it_and_the_daemon_serves_on(daemon):
    before = _resident(daemon)
    status, err = _complete(daemon, {"model": "broken"})
    assert status == 500 and err["error"]["code"] == "model_load_failed", err
    assert "LoRA adapter 'broken'" in err["error"]["message"] and "/tmp" not in err["error"]["message"]
    assert _resident(daemon) == before  # nothing let go for it
    assert _answer(daemon, "c") and daemon.wait_idle()["running"] == 0

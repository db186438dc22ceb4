"""Checks 7 and 9 with the built-in model, where the output itself matters."""

from __future__ import annotations

import asyncio

import pytest

from tests.daemon.helpers import Daemon, chat_body, session

from .conftest import assert_clean

pytestmark = pytest.mark.model

BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4  # SmolLM2-135M, fp32, 16-token blocks: K and V over 30 layers
QUESTIONS = [
    "Name three fruits.",
    "What is the boiling point of water?",
    "Write a two-line poem about rain.",
    "Who wrote Hamlet?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "What color is the sky at noon?",
    "Say hello in Italian.",
]


async def ask(s, text: str, n: int) -> dict:
    async with s.post("/v1/chat/completions", json=chat_body(text, max_tokens=n, temperature=0, ignore_eos=True)) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def test_check7_kv_oversubscription_preempts_and_outputs_stay_exact(short_tmp):
    # 12 usable blocks (192 tokens) for 8 requests that need ~6 blocks each: about 4x too small
    # The exact path: a prompt computed in other prefill chunks than alone gets the same text only where the
    # activations stay fp32 (8-bit activations round slightly different attention outputs apart)
    d = Daemon(
        short_tmp / "d.sock",
        "smollm2-135m-instruct",
        "--kv-cache-gb",
        f"{13.5 * BLOCK_BYTES / 2**30:.6f}",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "256",
        "--weights",
        "native-exact",
    ).wait_ready(300)
    try:
        assert d.stats()["kv_blocks_total"] == 12

        async def go():
            async with session(d.socket) as s:
                alone = [await ask(s, q, 48) for q in QUESTIONS]
                before = d.stats()["preemptions"]
                together = await asyncio.gather(*(ask(s, q, 48) for q in QUESTIONS))
                return alone, together, d.stats()["preemptions"] - before

        alone, together, preemptions = asyncio.run(go())
        assert preemptions > 0
        for a, t in zip(alone, together):
            assert t["usage"]["completion_tokens"] == 48
            assert t["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
        assert any(t["minibatch"]["preemptions"] > 0 for t in together)
        assert_clean(d)
    finally:
        assert d.stop() == 0


def test_check9_batch_invariance_in_both_modes(short_tmp):
    d = Daemon(
        short_tmp / "d.sock",
        "smollm2-135m-instruct",
        "--kv-cache-gb",
        "0.3",
        "--max-num-seqs",
        "16",
        "--max-wait-ms",
        "200",
    ).wait_ready(300)
    prompt = "Explain in two sentences why the sea is salty."
    try:

        async def go(mode: str):
            async with session(d.socket) as s:
                async with s.put("/v1/engine/mode", json={"mode": mode}) as r:
                    assert r.status == 202
                alone = await ask(s, prompt, 32)
                many = await asyncio.gather(*(ask(s, prompt, 32) for _ in range(16)))
                return alone, many

        for mode in ("continuous", "static"):
            alone, many = asyncio.run(go(mode))
            texts = {m["choices"][0]["message"]["content"] for m in many}
            assert texts == {alone["choices"][0]["message"]["content"]}, (mode, texts)
            assert d.get("/v1/engine/mode")[1]["mode"] == mode
        steps = d.get("/v1/engine/stats?steps=600")[1]["recent_steps"]
        assert max(s["running"] for s in steps) == 16  # they really ran as one batch
        assert_clean(d)
    finally:
        assert d.stop() == 0

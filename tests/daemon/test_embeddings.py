"""Embeddings through the real daemon and the built-in model, on the exact path (its GGUF blocks dequantised
exactly), by the openai SDK and the ollama client: the vector transformers computes on the same weights (the
final norm's output at the last token), the same alone as inside a batch of decoding chats, in the inputs'
order, base64 as the floats; bad input named; no block left behind a mixed load.
"""

from __future__ import annotations

import asyncio
import base64
import struct

import numpy as np
import pytest
import torch

from minibatch.daemon.client import request_json

from .helpers import running_daemon, session

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
ollama = pytest.importorskip("ollama")

MODEL = "smollm2-135m-instruct"
TEXTS = [
    "The cat sat on the mat.",
    "Paged attention keeps the KV cache in fixed-size blocks, as virtual memory keeps pages.",
    "Continuous batching admits new requests at every step.",
]


@pytest.fixture(scope="module")
def daemon():
    args = ("--max-num-seqs", "12", "--weights", "native-exact", "--max-model-len", "512")
    with running_daemon(MODEL, *args, prefix="mbm-") as d:
        yield d


def sdk(daemon) -> openai.OpenAI:
    transport = httpx.HTTPTransport(uds=str(daemon.socket))
    return openai.OpenAI(
        base_url="http://localhost/v1", api_key="unused", max_retries=0, http_client=httpx.Client(transport=transport)
    )


def unit(v) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64)
    return v / np.linalg.norm(v)


@pytest.mark.model
def test_the_vectors_are_transformers_last_hidden_state_in_order(daemon, builtin_model_dir):
    """Within 1e-5 of the float64 unit vectors of transformers' final hidden state at the last token (the same
    dequantised weights; float32 on both sides, summed in other orders)."""
    from minibatch.engine.text.tokenizer import TextTokenizer
    from minibatch.engine.weights.reference import load_hf_reference

    r = sdk(daemon).embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks for base64 and decodes it
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == MODEL
    tok = TextTokenizer(builtin_model_dir)
    ids = [tok.encode(t) for t in TEXTS]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(i) for i in ids)
    hf = load_hf_reference(builtin_model_dir)
    for got, prompt in zip(r.data, ids):
        with torch.no_grad():
            want = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1]
        assert len(got.embedding) == 576
        assert np.abs(np.asarray(got.embedding) - unit(want.double().numpy())).max() < 1e-5
        assert abs(np.linalg.norm(got.embedding) - 1) < 1e-6


@pytest.mark.model
def test_a_vector_is_the_same_alone_and_beside_eight_decoding_chats(daemon):
    """The same input alone, then while 8 chats decode in the same batch: equal within 1e-6 (each row's
    hidden states do not depend on the rows beside it on this path; float32 rounding is the allowance)."""
    alone = sdk(daemon).embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float").data[0].embedding

    async def busy():
        async with session(daemon.socket) as s:

            async def chat(i):
                body = {"messages": [{"role": "user", "content": f"Count to {i + 20}."}], "max_tokens": 40}
                async with s.post("/v1/chat/completions", json={**body, "ignore_eos": True}) as resp:
                    assert resp.status == 200
                    return await resp.json()

            chats = [asyncio.ensure_future(chat(i)) for i in range(8)]
            await asyncio.sleep(0.5)  # the chats are decoding
            async with s.post("/v1/embeddings", json={"input": [TEXTS[1]] * 2, "model": MODEL}) as resp:
                got = await resp.json()
            beside = not any(c.done() for c in chats)  # answered while every chat still decoded
            return got, beside, await asyncio.gather(*chats)

    got, beside, chats = asyncio.run(busy())
    assert beside
    assert all(c["usage"]["completion_tokens"] == 40 for c in chats)
    for item in got["data"]:
        assert np.abs(np.asarray(item["embedding"]) - np.asarray(alone)).max() < 1e-6
    assert daemon.wait_idle()["kv_blocks_used"] == 0


@pytest.mark.model
def test_base64_is_the_floats_and_ollamas_shapes(daemon):
    floats = sdk(daemon).embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float").data[0].embedding
    status, raw = request_json(
        str(daemon.socket), "POST", "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"}, timeout=30
    )
    assert status == 200
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == pytest.approx(floats, abs=1e-7)
    client = ollama.Client(host="http://localhost", transport=httpx.HTTPTransport(uds=str(daemon.socket)))
    e = client.embed(model=MODEL, input=TEXTS)
    assert len(e.embeddings) == 3 and e.prompt_eval_count > 0
    assert np.abs(np.asarray(e.embeddings[0]) - np.asarray(floats)).max() < 1e-6
    old = client.embeddings(model=MODEL, prompt=TEXTS[0]).embedding  # the older endpoint: not normalised
    assert np.linalg.norm(old) > 2 and np.abs(unit(old) - np.asarray(floats)).max() < 1e-6
    # token ids embed as their text does
    ids = request_json(str(daemon.socket), "POST", "/tokenize", {"content": TEXTS[0]})[1]["tokens"]
    by_ids = sdk(daemon).embeddings.create(model=MODEL, input=[ids], encoding_format="float").data[0].embedding
    assert np.abs(np.asarray(by_ids) - np.asarray(floats)).max() < 1e-6


@pytest.mark.model
def test_bad_input_is_a_400_naming_the_field_and_nothing_runs(daemon):
    long = "word " * 2000  # past the daemon's 512-token context
    cases = [
        ("/v1/embeddings", {"input": ["fine", ""]}, "input.1", "the input is empty"),
        ("/v1/embeddings", {"input": ["x"] * 513}, "input", "at most 512 inputs"),
        ("/v1/embeddings", {"input": ["fine", long]}, "input.1", "context limit"),
        ("/v1/embeddings", {"input": "fine", "dimensions": 577}, "dimensions", "have 576 dimensions"),
        ("/v1/embeddings", {"input": [[1, 2], [49152]]}, "input.1.0", "49152"),
        ("/v1/embeddings", {"input": [{"text": "x"}]}, "input.0", "must be a string"),
        ("/api/embed", {"input": long, "truncate": False}, "input", "context limit"),
    ]
    for path, body, param, words in cases:
        status, answer = request_json(str(daemon.socket), "POST", path, body, timeout=30)
        assert status == 400, (body, answer)
        error = answer["error"]
        message = error if isinstance(error, str) else error["message"]
        assert words in message and message.startswith(param), (param, answer)
        if isinstance(error, dict):
            assert error["param"] == param
    # Ollama's default cuts what is past the context instead
    status, answer = request_json(str(daemon.socket), "POST", "/api/embed", {"input": long}, timeout=60)
    assert status == 200 and answer["prompt_eval_count"] == 511  # one position is the next token's
    assert daemon.wait_idle()["kv_blocks_used"] == 0

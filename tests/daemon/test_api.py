"""The real daemon over its real socket: the OpenAI-compatible API, native endpoints, errors, disconnects."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import pytest

from minibatch.kernels.cpu import extension as cpu_kernels

from .helpers import Daemon, chat_body, read_sse, session


@pytest.fixture(scope="module")
def daemon(tiny_chat_model_dir, tmp_path_factory):
    import tempfile

    d = tempfile.mkdtemp(prefix="mbd-", dir="/tmp")
    sock = __import__("pathlib").Path(d) / "d.sock"
    daemon = Daemon(sock, tiny_chat_model_dir, "--max-num-seqs", "4", "--max-queue", "6", "--kv-cache-gb", "0.05")
    daemon.wait_ready()
    yield daemon
    assert daemon.stop() == 0, daemon.log_text()
    shutil.rmtree(d, ignore_errors=True)


def run(coro):
    return asyncio.run(coro)


def test_health_and_models(daemon, tiny_chat_model_dir):
    status, health = daemon.get("/health")
    assert status == 200 and health["status"] == "ok" and health["device"] == "cpu"
    # which build of the CPU kernels serves, and what its integer dot products run on
    assert health["cpu_kernels"] == cpu_kernels.describe(), health["cpu_kernels"]
    if cpu_kernels.load_cpu_extension() is not None:
        assert health["cpu_kernels"].rsplit(" ", 1)[1] in ("avx512-vnni", "avx-vnni", "avx2", "portable")
    # the operator named it by its path; the API shows its folder's name, never the server's path
    assert health["model"] == tiny_chat_model_dir.name and health["max_model_len"] == 1024
    assert str(tiny_chat_model_dir) not in str(health)
    status, models = daemon.get("/v1/models")
    assert status == 200 and models["object"] == "list"
    # the served model first, loaded; then what else the machine holds, loaded on first use
    first, *rest = models["data"]
    assert (first["id"], first["object"], first["loaded"], first["max_model_len"]) == (
        tiny_chat_model_dir.name,
        "model",
        True,
        1024,
    )
    assert ("smollm2-135m-instruct", False) in [(m["id"], m["loaded"]) for m in rest]
    assert [m["name"] for m in health["models"]] == [tiny_chat_model_dir.name]
    assert health["models"][0]["expires_at"] == "0001-01-01T00:00:00Z"  # the daemon's own stays loaded


def test_chat_completion_non_streaming(daemon):
    async def go():
        async with session(daemon.socket) as s:
            async with s.post(
                "/v1/chat/completions", json=chat_body(max_tokens=8, temperature=0, ignore_eos=True)
            ) as r:
                return r.status, await r.json()

    status, body = run(go())
    assert status == 200 and body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 8 and body["usage"]["prompt_tokens"] > 5
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 8
    t = body["minibatch"]
    assert {"queue_wait_ms", "ttft_ms", "decode_ms", "e2e_ms", "preemptions", "cached_prompt_tokens"} <= set(t)
    assert 0 <= t["queue_wait_ms"] <= t["ttft_ms"] <= t["e2e_ms"]


def test_an_image_to_a_model_without_a_tower_is_a_400_naming_it(daemon):
    from minibatch.daemon.client import request_json

    png = (
        "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJRU5E"
    )
    png += "rkJggg=="  # (one pixel)
    content = [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": png}}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    status, out = request_json(str(daemon.socket), "POST", "/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == "messages.0.content.1.image_url", out
    assert "does not take images" in out["error"]["message"]
    status, props = daemon.get("/props")
    assert status == 200 and props["modalities"] == {"vision": False, "audio": False}
    status, models = daemon.get("/v1/models")
    assert not any(card["vision"] for card in models["data"])
    assert props["total_slots"] >= 1 and props["chat_template"]


def test_chat_streaming_sse_format(daemon):
    async def go():
        async with session(daemon.socket) as s:
            body = chat_body(
                max_tokens=6, temperature=0, ignore_eos=True, stream=True, stream_options={"include_usage": True}
            )
            async with s.post("/v1/chat/completions", json=body) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                return await read_sse(r)

    events, raw = run(go())
    assert raw.endswith(b"data: [DONE]\n\n") and events[-1] == "[DONE]"
    assert raw.startswith(b"data: {") and b"\n\n\n" not in raw
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert (
        len(finals) == 1
        and finals[0]["choices"][0]["finish_reason"] == "length"
        and "ttft_ms" in finals[0]["minibatch"]
    )
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert len({c["id"] for c in chunks}) == 1


def test_a_paced_stream_sends_the_same_text_in_fewer_chunks(daemon):
    """stream_options.interval_ms: at most a chunk per interval after the first; the text is the same."""

    async def go(options):
        body = chat_body(max_tokens=80, temperature=0, ignore_eos=True, stream=True, stream_options=options)
        async with session(daemon.socket) as s:
            t0 = asyncio.get_running_loop().time()
            async with s.post("/v1/chat/completions", json=body) as r:
                events, _ = await read_sse(r)
            return events, asyncio.get_running_loop().time() - t0

    (plain, _), (paced, elapsed) = run(go({"include_usage": True})), run(go({"include_usage": True, "interval_ms": 40}))

    def content(events):
        return [
            c["choices"][0]["delta"]["content"]
            for c in events[:-1]
            if c["choices"] and c["choices"][0]["delta"].get("content")
        ]

    assert "".join(content(paced)) == "".join(content(plain)) and len(content(plain)) >= 40
    assert len(content(paced)) <= 2 + elapsed / 0.04
    assert paced[-2]["usage"]["completion_tokens"] == 80 and paced[-1] == "[DONE]"
    finals = [c for c in paced[:-1] if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"


def test_completions_text_and_token_prompt(daemon):
    async def go():
        async with session(daemon.socket) as s:
            async with s.post(
                "/v1/completions",
                json={"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "ignore_eos": True},
            ) as r:
                a = r.status, await r.json()
            async with s.post(
                "/v1/completions", json={"prompt": [1, 2, 3, 4], "max_tokens": 3, "stream": True, "ignore_eos": True}
            ) as r:
                b = r.status, await read_sse(r)
            return a, b

    (sa, a), (sb, (events, _)) = run(go())
    assert sa == 200 and a["object"] == "text_completion" and a["choices"][0]["finish_reason"] == "length"
    assert isinstance(a["choices"][0]["text"], str) and a["usage"]["completion_tokens"] == 5
    assert sb == 200 and events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "body,status,param,text",
    [
        (chat_body(temperature=3), 400, "temperature", "less than or equal to 2"),
        (chat_body(top_p=0), 400, "top_p", "greater than 0"),
        (chat_body(max_tokens=0), 400, "max_tokens", "greater than or equal to 1"),
        (chat_body(top_k=-2), 400, "top_k", "greater than or equal to -1"),
        (chat_body(presence_penalty=2.5), 400, "presence_penalty", "less than or equal to 2"),
        (chat_body(max_tokens="5"), 400, "max_tokens", "valid integer"),
        (chat_body(bogus=1), 400, "bogus", "unknown field"),
        ({"messages": []}, 400, "messages", "at least 1"),
        (
            {"messages": [{"role": "robot", "content": "x"}]},
            400,
            "messages.0.role",
            "'system', 'user', 'assistant' or 'tool'",
        ),
        (chat_body(n=9), 400, "n", "less than or equal to 8"),
        (chat_body(speculative="yes"), 400, "speculative", "valid boolean"),
        (chat_body(stream=True, stream_options={"interval_ms": 1001}), 400, "stream_options.interval_ms", "1000"),
        (chat_body(stream=True, stream_options={"interval_ms": -5}), 400, "stream_options.interval_ms", "0"),
        (chat_body(stream=True, stream_options={"interval_ms": "50"}), 400, "stream_options.interval_ms", "integer"),
        (chat_body(model="gpt-4"), 404, "model", "does not exist"),
        (chat_body(max_tokens=5000), 400, "max_tokens", "exceeds the context limit of 1024"),
        (chat_body("a lone \ud800 here"), 400, "messages.0.content", "lone UTF-16 surrogate"),
        (chat_body(stop=["ok", "\udfff"]), 400, "stop.1", "lone UTF-16 surrogate"),
    ],
)
def test_validation_errors_name_the_field(daemon, body, status, param, text):
    async def go():
        async with session(daemon.socket) as s:
            async with s.post("/v1/chat/completions", json=body) as r:
                return r.status, await r.json()

    got_status, err = run(go())
    assert got_status == status, err
    assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["param"] == param and text in err["error"]["message"], err


def test_context_error_names_both_numbers_and_runs_no_prefill(daemon):
    before = daemon.stats()["requests_finished"]
    steps_before = len(daemon.get("/v1/engine/stats?steps=600")[1]["recent_steps"])

    async def go():
        async with session(daemon.socket) as s:
            async with s.post("/v1/completions", json={"prompt": [5] * 1000, "max_tokens": 25}) as r:
                return r.status, await r.json()

    status, err = run(go())
    assert status == 400 and "1000 tokens" in err["error"]["message"] and "max_tokens (25)" in err["error"]["message"]
    assert "1024" in err["error"]["message"]
    assert daemon.stats()["requests_finished"] == before
    assert len(daemon.get("/v1/engine/stats?steps=600")[1]["recent_steps"]) == steps_before


def test_stats_steps_is_how_many_recent_steps_come_back(daemon):
    """`steps=N` gives the newest N step records, oldest first; `steps=0` gives none (callers that poll
    the counters ask for none, and must not be handed the whole ring)."""

    async def go():
        async with session(daemon.socket) as s:
            async with s.post("/v1/completions", json={"prompt": [5] * 8, "max_tokens": 6, "speculative": False}) as r:
                assert r.status == 200, await r.text()

    run(go())
    daemon.wait_idle()  # no step between the reads below (an earlier test's request may still be ending)
    assert daemon.get("/v1/engine/stats?steps=0")[1]["recent_steps"] == []
    three = daemon.get("/v1/engine/stats?steps=3")[1]["recent_steps"]
    many = daemon.get("/v1/engine/stats?steps=600")[1]["recent_steps"]
    assert len(three) == 3 and len(many) >= 6  # a prefill and a step per token at least
    assert three == many[-3:]
    assert [s["step"] for s in three] == sorted(s["step"] for s in three)


def test_bad_json_and_wrong_method_use_the_error_shape(daemon):
    async def go():
        async with session(daemon.socket) as s:
            async with s.post("/v1/chat/completions", data=b"{not json") as r:
                a = r.status, await r.json()
            async with s.get("/v1/chat/completions") as r:
                b = r.status, await r.json()
            async with s.get("/nope") as r:
                c = r.status, await r.json()
            return a, b, c

    (sa, a), (sb, b), (sc, c) = run(go())
    assert sa == 400 and a["error"]["code"] == "invalid_json"
    assert sb == 405 and "error" in b and sc == 404 and "error" in c


def test_queue_overflow_gets_429_with_retry_after_and_the_rest_complete(daemon):
    async def one(s):
        async with s.post("/v1/chat/completions", json=chat_body(max_tokens=200, ignore_eos=True)) as r:
            return r.status, dict(r.headers), await r.json()

    async def go():
        async with session(daemon.socket) as s:
            return await asyncio.gather(*(one(s) for _ in range(20)))

    results = run(go())
    codes = [r[0] for r in results]
    # 4 running + 6 waiting are accepted; exactly the other 10 are refused
    assert set(codes) == {200, 429} and codes.count(429) == 10
    for status, headers, body in results:
        if status == 429:
            assert headers["Retry-After"] == "1" and body["error"]["code"] == "queue_full"
        else:
            assert body["usage"]["completion_tokens"] == 200
    daemon.wait_idle()


def test_stats_and_events_move_while_requests_run(daemon):
    async def go():
        async with session(daemon.socket) as s:
            events = []

            async def listen():
                async with s.get("/v1/engine/events") as r:
                    async for line in r.content:
                        if line.startswith(b"data: "):
                            events.append(json.loads(line[6:]))
                            if len(events) >= 5:
                                return

            listener = asyncio.create_task(listen())
            await asyncio.sleep(0.2)
            # one token a step and 300 of them: well over five event intervals (50 ms) of work, however fast
            body = chat_body(max_tokens=300, ignore_eos=True, speculative=False)
            jobs = [s.post("/v1/chat/completions", json=body) for _ in range(3)]
            responses = await asyncio.gather(*jobs)
            await asyncio.wait_for(listener, 30)
            for r in responses:
                await r.json()
            return events

    events = run(go())
    assert max(e["running"] for e in events) >= 1 and max(e["kv_blocks_used"] for e in events) > 0
    assert all({"mode", "waiting", "decode_tokens", "step_time", "decode_tokens_per_s"} <= set(e) for e in events)
    assert len({e["step"] for e in events}) == len(events)  # each event a newer step
    stats = daemon.wait_idle()
    assert stats["requests_finished"] >= 3 and stats["kv_blocks_used"] == 0


def test_steps_endpoint_returns_the_rows_of_each_step(daemon):
    """Three requests at once: their ids hold rows in the step records from prefill to their last decode."""
    before = daemon.get("/v1/engine/steps?since=99999999")[1]["last_step"]

    async def go():
        async with session(daemon.socket) as s:

            async def one(n):
                async with s.post("/v1/chat/completions", json=chat_body(max_tokens=n, ignore_eos=True)) as r:
                    body = await r.json()
                    return body["id"], body

            return await asyncio.gather(one(4), one(6), one(9))

    done = run(go())
    status, data = daemon.get(f"/v1/engine/steps?since={before}")
    assert status == 200 and data["max_rows"] == 4 and data["capacity"] == 512
    steps = data["steps"]
    assert (
        steps
        and steps[0]["step"] == before + 1
        and [s["step"] for s in steps] == list(range(before + 1, data["last_step"] + 1))
    )
    for rid, body in done:
        mine = [(s["step"], row) for s in steps for row in s["rows"] if row[1] == rid]
        states = [row[3] for _, row in mine]
        # after the prefill's token, each decode row takes one token, a verifying row its accepted drafts too
        taken = sum(1 + row[5] for _, row in mine if row[3] in ("d", "v"))
        assert states[0] == "p" and taken == body["usage"]["completion_tokens"] - 1, mine
        assert all(row[5] <= row[4] for _, row in mine) and all((row[3] == "v") == (row[5] > 0) for _, row in mine)
        assert len({row[0] for _, row in mine}) == 1  # one row for its whole life
        cached = body["minibatch"]["cached_prompt_tokens"]  # served from the prefix cache: not computed
        assert sum(row[2] for _, row in mine if row[3] == "p") == body["usage"]["prompt_tokens"] - cached
    assert all({"step", "t", "ms", "mode", "waiting", "rows", "preempted"} <= set(s) for s in steps)
    assert daemon.get(f"/v1/engine/steps?since={data['last_step']}")[1]["steps"] == []
    status, err = daemon.get("/v1/engine/steps?since=-1")
    assert status == 400 and err["error"]["param"] == "since"


def test_logprobs_in_chat_stream_and_completions(daemon):
    async def go():
        async with session(daemon.socket) as s:
            async with s.post(
                "/v1/chat/completions",
                json=chat_body(max_tokens=6, ignore_eos=True, temperature=0, logprobs=True, top_logprobs=3),
            ) as r:
                full = await r.json()
            async with s.post(
                "/v1/chat/completions",
                json=chat_body(max_tokens=6, ignore_eos=True, temperature=0, logprobs=True, stream=True),
            ) as r:
                events, _ = await read_sse(r)
            async with s.post(
                "/v1/completions",
                json={"prompt": "Once upon", "max_tokens": 5, "ignore_eos": True, "temperature": 0, "logprobs": 2},
            ) as r:
                legacy = await r.json()
            async with s.post("/v1/chat/completions", json=chat_body(top_logprobs=2)) as r:
                bad = r.status, await r.json()
            async with s.post("/v1/chat/completions", json=chat_body(logprobs=True, top_logprobs=21)) as r:
                too_many = r.status, await r.json()
            async with s.post("/v1/chat/completions", json=chat_body(max_tokens=2)) as r:
                plain = await r.json()
            return full, events, legacy, bad, too_many, plain

    full, events, legacy, bad, too_many, plain = run(go())
    content = full["choices"][0]["logprobs"]["content"]
    assert len(content) == full["usage"]["completion_tokens"] == 6
    for item in content:
        assert item["logprob"] <= 0 and item["bytes"] == list(item["token"].encode()) and len(item["top_logprobs"]) == 3
        top = item["top_logprobs"]
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert top[0]["token"] == item["token"] and top[0]["logprob"] == pytest.approx(item["logprob"])  # greedy
    streamed = [
        c
        for e in events
        if isinstance(e, dict) and e.get("choices")
        for c in ((e["choices"][0].get("logprobs") or {}).get("content") or [])
    ]
    assert [c["token"] for c in streamed] == [c["token"] for c in content]  # the same greedy tokens, chunk by chunk
    assert all(c["top_logprobs"] == [] for c in streamed)
    lp = legacy["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert all(len(t) <= 2 for t in lp["top_logprobs"]) and lp["text_offset"] == sorted(lp["text_offset"])
    assert bad[0] == 400 and bad[1]["error"]["param"] == "top_logprobs"
    assert too_many[0] == 400 and too_many[1]["error"]["param"] == "top_logprobs"
    assert plain["choices"][0]["logprobs"] is None


def test_mode_switch_under_load(daemon):
    async def go():
        async with session(daemon.socket) as s:
            jobs = [
                asyncio.ensure_future(s.post("/v1/chat/completions", json=chat_body(max_tokens=50, ignore_eos=True)))
                for _ in range(4)
            ]
            await asyncio.sleep(0.3)
            async with s.put("/v1/engine/mode", json={"mode": "static"}) as r:
                put = r.status, await r.json()
            async with s.put("/v1/engine/mode", json={"mode": "sideways"}) as r:
                bad = r.status, await r.json()
            results = [await (await j).json() for j in jobs]
            for _ in range(100):
                async with s.get("/v1/engine/mode") as r:
                    mode = await r.json()
                if mode["mode"] == "static":
                    break
                await asyncio.sleep(0.05)
            async with s.get("/health") as r:
                health = await r.json()
            async with s.post("/v1/chat/completions", json=chat_body(max_tokens=5, ignore_eos=True)) as r:
                static_answer = await r.json()
            async with s.put("/v1/engine/mode", json={"mode": "continuous"}) as r:
                await r.json()
            return put, bad, results, mode, static_answer, health

    put, bad, results, mode, static_answer, health = run(go())
    assert health["mode"] == "static"  # /health says what the engine runs now, not what it started with
    assert put[0] == 202 and put[1]["requested_mode"] == "static"
    assert bad[0] == 400 and bad[1]["error"]["param"] == "mode"
    assert all(r["usage"]["completion_tokens"] == 50 for r in results)  # nothing dropped or restarted
    assert mode["mode"] == "static" and static_answer["usage"]["completion_tokens"] == 5
    daemon.wait_idle()


def test_disconnect_mid_stream_frees_kv(daemon):
    async def go():
        async with session(daemon.socket) as s:
            r = await s.post("/v1/chat/completions", json=chat_body(max_tokens=500, ignore_eos=True, stream=True))
            got = 0
            async for line in r.content:
                if line.startswith(b"data: "):
                    got += 1
                    if got == 4:
                        break
            r.close()  # drop the connection mid-stream
            return got

    assert run(go()) == 4
    stats = daemon.wait_idle(10)
    assert stats["kv_blocks_used"] == 0


def test_metrics_prometheus_text(daemon):
    _, health = daemon.get("/health")
    model = health["model"]

    async def go():
        async with session(daemon.socket) as s:
            async with s.get("/metrics") as r:
                return r.status, r.headers["Content-Type"], await r.text()

    status, ctype, text = run(go())
    assert status == 200 and ctype.startswith("text/plain")
    for name in (
        "minibatch_running_requests",
        "minibatch_kv_cache_usage_ratio",
        "minibatch_time_to_first_token_seconds_bucket",
        "minibatch_preemptions_total",
        f'minibatch_mode{{mode="continuous",model="{model}"}} 1.0',  # every series names its model
        f'minibatch_model_loaded{{model="{model}"}} 1.0',
    ):
        assert name in text, name


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_over_the_unix_socket(daemon):
    body = json.dumps(chat_body(max_tokens=4, ignore_eos=True, stream=True))
    out = subprocess.run(
        [
            "curl",
            "-sN",
            "--unix-socket",
            str(daemon.socket),
            "http://localhost/v1/chat/completions",
            "-H",
            "Content-Type: application/json",
            "-d",
            body,
        ],
        capture_output=True,
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout.endswith(b"data: [DONE]\n\n") and b"chat.completion.chunk" in out.stdout


def test_speculation_shows_in_timings_stats_and_metrics(daemon):
    """The same greedy answer with and without speculation; the drafts counted per response and in the stats."""
    text = "one two three one two three one two three one two three"

    async def go():
        async with session(daemon.socket) as s:
            out = {}
            for spec in (True, False):
                body = chat_body(text, max_tokens=40, temperature=0, ignore_eos=True, speculative=spec)
                async with s.post("/v1/chat/completions", json=body) as r:
                    out[spec] = (r.status, await r.json())
            return out

    out = run(go())
    (s_on, on), (s_off, off) = out[True], out[False]
    assert s_on == s_off == 200
    assert on["choices"][0]["message"]["content"] == off["choices"][0]["message"]["content"]
    mine, plain = on["minibatch"], off["minibatch"]
    assert plain["draft_tokens"] == plain["accepted_tokens"] == 0
    assert 0 < mine["accepted_tokens"] <= mine["draft_tokens"], mine  # the tiny model loops: drafts pay
    stats = daemon.stats()
    assert stats["speculative"] == "ngram" and stats["accepted_tokens"] >= mine["accepted_tokens"]
    assert stats["draft_tokens"] >= mine["draft_tokens"] and stats["verify_rows"] > 0
    _, metrics = daemon.get("/metrics")
    assert "minibatch_spec_accepted_tokens_total" in metrics.get("raw", "")
    assert daemon.get("/health")[1]["speculative"] == "ngram (up to 4 tokens)"

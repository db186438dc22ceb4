"""The ingress's routing key and the cluster views, without Ray: prompt text -> block hashes, the prefix table,
rendezvous hashing, and the aggregates of replicas' answers."""

from __future__ import annotations

from minibatch.daemon.cluster import aggregate
from minibatch.daemon.cluster.prefix import (
    BLOCK_CHARS,
    MAX_CHARS,
    PrefixTable,
    block_hashes,
    prompt_segments,
    rendezvous,
)

SYSTEM = {"role": "system", "content": "You are a terse assistant who answers in one sentence."}


def chat(*messages):
    return prompt_segments("/v1/chat/completions", {"messages": list(messages)})


def test_a_conversations_next_turn_holds_every_hash_of_the_one_before():
    turn1 = [SYSTEM, {"role": "user", "content": "hi"}]  # shorter than a block: the message ends line up
    turn2 = turn1 + [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is a tide?"}]
    h1, h2 = block_hashes(chat(*turn1)), block_hashes(chat(*turn2))
    assert set(h1) <= set(h2)
    assert h2[: len(h1)] == h1
    other = block_hashes(chat(SYSTEM, {"role": "user", "content": "ho"}))
    assert other[0] == h1[0] and other[-1] != h1[-1]  # same system prompt, different question


def test_hashes_cut_every_block_and_stop_at_the_cap():
    text = "x" * (3 * BLOCK_CHARS + 5)
    assert len(block_hashes([text])) == 4
    assert len(block_hashes(["y" * (MAX_CHARS + 1000)])) == MAX_CHARS // BLOCK_CHARS
    assert block_hashes(["ab", "cd"])[-1] == block_hashes(["abcd"])[-1]  # a hash covers the text, not the cuts


def test_segments_of_each_request_kind():
    assert prompt_segments("/v1/completions", {"prompt": "Once"}) == ["Once"]
    assert prompt_segments("/v1/completions", {"prompt": ["One", "Two"]}) == ["One"]
    assert prompt_segments("/v1/completions", {"prompt": [1, 2, 3]}) == ["1 2 3"]
    assert prompt_segments("/api/generate", {"prompt": "Go", "system": "Be brief"}) == ["<system>Be brief", "Go"]
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert prompt_segments("/api/chat", {"messages": [{"role": "user", "content": parts}]}) == ["<user>ab"]
    tools = prompt_segments("/v1/chat/completions", {"messages": [SYSTEM], "tools": [{"type": "function"}]})
    assert tools[0].startswith("[{") and len(tools) == 2
    for bad in ({}, {"messages": []}, {"messages": "x"}, {"messages": [1]}, [], {"prompt": ""}):
        assert prompt_segments("/v1/chat/completions", bad) is None
        assert prompt_segments("/v1/completions", bad) is None
    assert prompt_segments("/v1/models", {"prompt": "x"}) is None


def test_the_table_finds_the_longest_recorded_start_of_a_live_replica():
    table = PrefixTable(capacity=100)
    a = block_hashes(["p" * 200])
    b = block_hashes(["p" * 200 + "q" * 100])
    table.record(a, "r1")
    assert table.longest_match(b, {"r1", "r2"}) == ("r1", len(a) - 1)  # a's last partial block is its own
    assert table.longest_match(b, {"r2"}) == (None, 0)  # r1 is gone: no match
    table.record(b, "r2")
    assert table.longest_match(b, {"r1", "r2"}) == ("r2", len(b))
    table.forget("r2")  # the start both shared was last sent to r2: it goes with r2
    assert table.longest_match(b, {"r1", "r2"}) == (None, 0)
    assert table.longest_match(a, {"r1"}) == ("r1", len(a))
    small = PrefixTable(capacity=3)
    small.record(block_hashes(["z" * 64 * 5]), "r1")
    assert len(small) == 3  # least recently used out first


def test_rendezvous_moves_only_the_keys_of_a_replica_that_leaves():
    replicas = ["a", "b", "c"]
    keys = range(300)
    before = {k: rendezvous(k, replicas) for k in keys}
    assert {v for v in before.values()} == set(replicas)
    after = {k: rendezvous(k, ["a", "c"]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "b" for k in moved)
    assert 60 < sum(1 for v in before.values() if v == "a") < 140  # about a third each


def test_stats_sum_the_replicas_and_weight_the_hit_rate_by_prompt_tokens():
    one = {
        "running": 2,
        "max_num_seqs": 32,
        "waiting": 1,
        "kv_blocks_used": 10,
        "kv_blocks_total": 100,
        "prompt_tokens": 100,
        "cached_prompt_tokens": 90,
        "decode_tokens_per_s": 5.0,
        "mode": "static",
        "pending_mode": None,
        "block_size": 16,
        "last_error": None,
    }
    two = {
        **one,
        "running": 1,
        "kv_blocks_used": 30,
        "prompt_tokens": 300,
        "cached_prompt_tokens": 10,
        "decode_tokens_per_s": 7.0,
    }
    s = aggregate.stats({"r2": two, "r1": one})
    assert (s["running"], s["max_num_seqs"], s["waiting"]) == (3, 64, 2)
    assert s["kv_usage_percent"] == 20.0 and s["decode_tokens_per_s"] == 12.0
    assert s["prefix_cache_hit_rate"] == 0.25 and s["mode"] == "static"
    assert [r["replica"] for r in s["replicas"]] == ["r1", "r2"]
    ev = aggregate.event(
        {"r1": {**one, "step": 4, "step_time": 0.01}, "r2": {**two, "step": 9, "step_time": 0.03}}, 1.0
    )
    assert ev["running"] == 3 and ev["step"] == 9 and ev["step_time"] == 0.03
    assert ev["replicas"][1] == {
        "replica": "r2",
        "mode": "static",
        "pending_mode": None,
        "running": 1,
        "max_num_seqs": 32,
        "waiting": 1,
        "kv_blocks_used": 30,
        "kv_blocks_total": 100,
        "kv_usage_percent": None,  # the replica's own, which this one did not send
        "prefill_tokens_per_s": None,
        "decode_tokens_per_s": 7.0,
        "steps_per_s": None,
    }


def test_metrics_label_every_sample_with_its_replica_and_keep_one_help_per_family():
    text = (
        "# HELP minibatch_running_requests Requests in the batch\n"
        "# TYPE minibatch_running_requests gauge\n"
        "minibatch_running_requests 2.0\n"
        "# HELP minibatch_requests_total Finished requests\n"
        "# TYPE minibatch_requests_total counter\n"
        'minibatch_requests_total{finish_reason="stop"} 5.0\n'
    )
    out = aggregate.metrics({"b": text, "a": text.replace("2.0", "3.0")}, "own_metric 1\n")
    lines = out.splitlines()
    assert lines.count("# HELP minibatch_running_requests Requests in the batch") == 1
    assert 'minibatch_running_requests{replica="a"} 3.0' in lines
    assert 'minibatch_running_requests{replica="b"} 2.0' in lines
    assert 'minibatch_requests_total{replica="a",finish_reason="stop"} 5.0' in lines
    i = lines.index("# TYPE minibatch_requests_total counter")
    assert lines[i + 1].startswith("minibatch_requests_total{replica=")  # samples stay under their family
    assert lines[-1] == "own_metric 1"

"""Embedding requests in the engine: prefill-only rows of the same batch as generating requests.

Each pooling (last, mean, cls) equals the tiny model's own hidden states computed alone in one forward; the
prompt may come in chunks, meet a prefix-cache hit, or be preempted and recomputed; generating requests
beside them are untouched; every block comes back and the timeline marks the embedding's rows as such.
"""

from __future__ import annotations

import pytest
import torch

from minibatch.engine.core.sampling_params import SamplingParams
from minibatch.engine.core.timeline import EMBED
from minibatch.engine.factory import EngineConfig, build_engine


def engine(model_dir, mode="continuous", blocks=400, chunk=16):
    config = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        mode=mode,
        max_num_seqs=8,
        num_kv_blocks=blocks,
        max_num_batched_tokens=chunk,
        max_wait_ms=0,
    )
    return build_engine(config)


def reference(e, prompt: list[int], pooling: str) -> torch.Tensor:
    """The model's final hidden states for the whole prompt in one forward, alone, pooled."""
    alone = engine(e.info.model_dir, chunk=4096)
    from minibatch.engine.attention.metadata import build_flat_batch

    runner = alone.runner
    blocks = list(range(1, len(prompt) // alone.info.block_size + 2))
    batch = build_flat_batch([prompt], [0], [blocks], alone.info.block_size, runner.device)
    with torch.inference_mode():
        hidden = runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.attn)
    return {"last": hidden[-1], "mean": hidden.double().mean(0).float(), "cls": hidden[0]}[pooling]


def run(e) -> dict:
    done = {}
    while e.has_work():
        outputs, _ = e.step()
        e.scheduler.blocks.check_integrity()
        done.update({o.request_id: o for o in outputs if o.finished})
    assert e.scheduler.blocks.num_used_blocks == 0
    return done


@pytest.mark.parametrize(
    "mode,blocks",
    [("continuous", 400), ("continuous", 12), ("static", 400)],
    ids=["continuous", "preempting", "static"],
)
def test_embeddings_beside_generation_equal_the_model_alone(tiny_chat_model_dir, mode, blocks):
    prompts = {
        f"e-{p}-{i}": (p, [100 + i * 7 + j % 50 for j in range(40 + 9 * i)])
        for p in ("last", "mean", "cls")
        for i in range(2)
    }
    plain = engine(tiny_chat_model_dir, mode, blocks)
    gen_params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref_gen = plain.add_request("g", list(range(300, 340)), gen_params)
    run(plain)

    e = engine(tiny_chat_model_dir, mode, blocks)
    gens = [e.add_request(f"g{i}", list(range(300, 340)), gen_params) for i in range(3)]
    for rid, (pooling, prompt) in prompts.items():
        e.add_request(rid, prompt, SamplingParams(max_tokens=1), pooling=pooling)
    done = run(e)
    for rid, (pooling, prompt) in prompts.items():
        out = done[rid]
        assert out.finish_reason == "stop" and out.token_ids == [] and out.text == ""
        want = reference(e, prompt, pooling)
        assert torch.allclose(torch.tensor(out.embedding), want, atol=1e-4, rtol=1e-4), (rid, mode)
    assert all(g.output_token_ids == ref_gen.output_token_ids for g in gens)
    if blocks == 12:
        assert e.scheduler.num_preemptions > 0
    states = {state for rec in e.timeline.since(0) for _, rid, _, state, *_ in rec.rows if rid.startswith("e-")}
    assert EMBED in states and "d" not in states and "v" not in states


def test_a_prefix_cache_hit_serves_last_pooling_but_never_skips_a_mean_position(tiny_chat_model_dir):
    """Last-token pooling takes the cached prefix (only the last position is read); mean pooling computes
    every position however much of the prompt the cache holds, and both equal the model alone."""
    e = engine(tiny_chat_model_dir)
    prompt = list(range(500, 580))
    e.add_request("warm", prompt, SamplingParams(max_tokens=1, temperature=0))
    run(e)
    last = e.add_request("last", prompt, SamplingParams(max_tokens=1), pooling="last")
    mean = e.add_request("mean", prompt, SamplingParams(max_tokens=1), pooling="mean")
    done = run(e)
    assert last.num_cached_tokens > 0 and mean.num_cached_tokens == 0
    assert torch.allclose(torch.tensor(done["last"].embedding), reference(e, prompt, "last"), atol=1e-4, rtol=1e-4)
    assert torch.allclose(torch.tensor(done["mean"].embedding), reference(e, prompt, "mean"), atol=1e-4, rtol=1e-4)


def test_an_aborted_embedding_frees_its_blocks_and_its_running_sum(tiny_chat_model_dir):
    e = engine(tiny_chat_model_dir, chunk=8)
    e.add_request("m", list(range(100, 164)), SamplingParams(max_tokens=1), pooling="mean")
    e.step()
    assert "m" in e.runner.pooling_sums
    e.abort("m")
    run(e)
    assert "m" not in e.runner.pooling_sums
    with pytest.raises(ValueError, match="pooling must be one of"):
        e.add_request("x", [1, 2], SamplingParams(max_tokens=1), pooling="max")

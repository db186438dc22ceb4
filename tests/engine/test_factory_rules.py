"""The engine factory's rules that need no model: the KV pool budget and the GPU kernels' shape limits."""

from __future__ import annotations

import pytest
import torch

import minibatch.engine.factory as factory
from minibatch.engine.attention.select import gpu_shape_problems
from minibatch.engine.factory import EngineConfig, kv_budget


def test_kv_budget_is_one_rule_on_every_device(monkeypatch):
    monkeypatch.setattr(factory, "available_memory_bytes", lambda: 10 * 2**30)
    assert kv_budget(EngineConfig(), "cpu") == (2**30, "0.1 of 10.0 GiB available memory")
    assert kv_budget(EngineConfig(kv_cache_fraction=0.25), "cpu")[0] == int(2.5 * 2**30)
    assert kv_budget(EngineConfig(kv_cache_gb=0.5, kv_cache_fraction=0.9), "cpu") == (2**29, "--kv-cache-gb 0.5")

    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (calls.append("mem_get_info") or 40 * 2**30, 80 * 2**30))
    budget, rule = kv_budget(EngineConfig(), "cuda")
    # measured after the allocator hands back the load's temporary copies
    assert calls == ["empty_cache", "mem_get_info"]
    assert budget == int(0.8 * 40 * 2**30) and rule == "0.8 of 40.0 GiB free GPU memory"
    assert kv_budget(EngineConfig(kv_cache_fraction=0.5), "cuda")[0] == 20 * 2**30


def test_kv_fraction_out_of_range_is_refused_naming_it():
    for bad in (0, -0.1, 0.99, 2):
        with pytest.raises(ValueError, match="kv_cache_fraction must be in"):
            EngineConfig(kv_cache_fraction=bad)


def test_gpu_shape_limits_are_reported_with_the_reason():
    assert gpu_shape_problems(9, 3, 64, 16) == []
    assert gpu_shape_problems(32, 8, 128, 128) == []
    problems = gpu_shape_problems(8, 8, 80, 4)
    assert len(problems) == 2 and "block_size 4" in problems[0] and "head_dim 80" in problems[1]
    assert "head_dim 8" in gpu_shape_problems(8, 8, 8, 16)[0]  # tl.dot needs 16
    assert "block_size 256" in gpu_shape_problems(8, 8, 64, 256)[0]
    assert "not a multiple" in gpu_shape_problems(6, 4, 64, 16)[0]


def test_generation_config_gives_stop_tokens_and_sampling_defaults(tmp_path):
    from minibatch.engine.factory import generation_config

    (tmp_path / "generation_config.json").write_text(
        '{"eos_token_id": [128001, 128008, 128009], "temperature": 0.6, "top_p": 0.9, '
        '"do_sample": true, "max_length": 4096}'
    )
    assert generation_config(tmp_path) == ({128001, 128008, 128009}, {"temperature": 0.6, "top_p": 0.9})
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 2}')
    assert generation_config(tmp_path) == ({2}, {})
    assert generation_config(tmp_path / "nowhere") == (set(), {})


def test_a_kv_pool_in_tokens_holds_that_many_and_the_null_block(tiny_chat_model_dir):
    with pytest.raises(ValueError, match="kv_cache_tokens must be at least one block"):
        EngineConfig(kv_cache_tokens=8)
    engine = factory.build_engine(EngineConfig(model=str(tiny_chat_model_dir), kv_cache_tokens=100, kv_cache_gb=5.0))
    assert engine.info.num_kv_blocks == 7 + 1 and engine.info.kv_budget == "--kv-cache-tokens 100"


def test_rotary_tables_hold_the_positions_the_pool_can_reach(tiny_chat_model_dir):
    """A pool smaller than the model's context: the tables stop where a sequence must, and a request that
    fills the whole pool still decodes to its last position with the same tokens as with a large pool."""
    from minibatch.engine.core.sampling_params import SamplingParams

    def run(tokens: int | None):
        engine = factory.build_engine(
            EngineConfig(model=str(tiny_chat_model_dir), kv_cache_tokens=tokens, max_num_seqs=1)
        )
        prompt = [5 + i % 50 for i in range(100)]
        engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=28, ignore_eos=True))
        out = []
        while engine.has_work():
            out += [t for o in engine.step()[0] for t in o.token_ids]
        return engine, out

    small, tokens = run(128)  # 8 blocks of 16: 128 positions
    rotary = small.runner.model.model.rotary
    assert rotary.cos.shape[0] == (small.info.num_kv_blocks - 1) * small.info.block_size == 128
    assert small.info.max_model_len > 128  # the model's context is longer than the pool
    big, expected = run(None)
    assert big.runner.model.model.rotary.cos.shape[0] == big.info.max_model_len
    assert len(tokens) == 28 and tokens == expected

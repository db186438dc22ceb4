"""The CPU KV pool: zeros, K and V tensors per layer over one mapping, memory taken only as blocks are written,
each in its cache type; and the types' choice (--kv-cache-type) and byte counts."""

from __future__ import annotations

from types import SimpleNamespace

import psutil
import pytest

from minibatch.engine.factory import EngineConfig, default_kv_types
from minibatch.engine.runner.kv_cache import allocate_kv_cache, bytes_per_block, bytes_per_token
from minibatch.kernels.kv_types import KVCacheTypes


@pytest.mark.parametrize(
    "types,k_shape,v_shape",
    [
        (KVCacheTypes("f32", "f32"), (64,), (64,)),
        (KVCacheTypes("q8_0", "q8_0"), (68,), (68,)),
        (KVCacheTypes("q8_0", "f16"), (68,), (64,)),
        (KVCacheTypes("bf16", "f32"), (64,), (64,)),
    ],
)
def test_the_pool_is_zero_its_layers_apart_and_costs_memory_only_as_written(types, k_shape, v_shape):
    cfg = SimpleNamespace(num_layers=4, num_kv_heads=2, head_dim=64)
    blocks, block_size = 4096, 16
    proc = psutil.Process()
    before = proc.memory_info().rss
    caches = allocate_kv_cache(cfg, blocks, block_size, types)
    reserved = bytes_per_block(cfg, block_size, types) * blocks
    assert proc.memory_info().rss - before < reserved // 4  # mapped, not yet committed
    assert [(c.k.shape, c.v.shape) for c in caches] == [
        ((blocks, block_size, 2, *k_shape), (blocks, block_size, 2, *v_shape))
    ] * 4
    assert all(t.is_contiguous() and not t.any() for c in caches for t in c)
    ends = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for c in caches for t in c)
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))  # no two tensors share a byte
    caches[1].k[7] = 1  # one block's K in one layer: no other layer, block or V sees it
    assert caches[1].k[7].all() and int(caches[1].k.count_nonzero()) == block_size * 2 * k_shape[0]
    assert not caches[1].v.any() and not any(t.any() for i, c in enumerate(caches) if i != 1 for t in c)


def test_bytes_per_token_are_llama_cpps():
    """Qwen2.5-0.5B: 24 layers x 2 KV heads x 64 values, K and V: llama.cpp's f16 and q8_0 figures."""
    qwen = SimpleNamespace(num_layers=24, num_kv_heads=2, head_dim=64)
    assert bytes_per_token(qwen, KVCacheTypes("f32", "f32")) == 24_576
    assert bytes_per_token(qwen, KVCacheTypes("f16", "f16")) == 12_288
    assert bytes_per_token(qwen, KVCacheTypes("q8_0", "q8_0")) == 6_528
    assert bytes_per_token(qwen, KVCacheTypes("q8_0", "f16")) == 6_528 // 2 + 12_288 // 2
    # the 4- and 5-bit types: 18, 20, 22, 24 bytes a block of 32 (Qwen2.5-0.5B: 24 layers x 2 KV heads x 2 blocks)
    for kv_type, block in (("q4_0", 18), ("iq4_nl", 18), ("q4_1", 20), ("q5_0", 22), ("q5_1", 24)):
        assert bytes_per_token(qwen, KVCacheTypes(kv_type, kv_type)) == 24 * 2 * 2 * block * 2


def test_the_option_takes_one_type_or_a_pair_and_names_the_types_when_wrong():
    assert KVCacheTypes.parse("q8_0") == KVCacheTypes("q8_0", "q8_0")
    assert KVCacheTypes.parse("q8_0, f16") == KVCacheTypes("q8_0", "f16")
    assert str(KVCacheTypes("q8_0", "f16")) == "q8_0,f16" and str(KVCacheTypes("f16", "f16")) == "f16"
    assert KVCacheTypes.parse("q5_1,iq4_nl") == KVCacheTypes("q5_1", "iq4_nl")
    for bad in ("q3_k", "f16,q5", "f16,f16,f16", "", "Q4_0"):
        with pytest.raises(ValueError, match="kv_cache_type.*f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0, iq4_nl"):
            EngineConfig(kv_cache_type=bad)


def test_the_default_type():
    assert default_kv_types("cpu", "float32", exact_weights=False, head_dim=64) == KVCacheTypes("q8_0", "q8_0")
    assert default_kv_types("cpu", "float32", exact_weights=False, head_dim=80) == KVCacheTypes("f16", "f16")
    assert default_kv_types("cpu", "float32", exact_weights=True, head_dim=64) == KVCacheTypes("f32", "f32")
    assert default_kv_types("cuda", "bfloat16", exact_weights=False, head_dim=64) == KVCacheTypes("bf16", "bf16")

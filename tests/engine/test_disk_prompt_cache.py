"""The disk prompt cache with real engines, files and KV blocks: a new engine (a restart) reads a prefix back and
answers the same; anything that changes a block's contents is a miss; torn, corrupt, missing and unwritable
files are misses, never a wrong block or a failed request; the folder keeps its budget."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import time

import pytest
import torch

from minibatch.engine.core.block_manager import block_hash
from minibatch.engine.core.kv_tier import BlockKey
from minibatch.engine.core.sampling_params import SamplingParams
from minibatch.engine.factory import EngineConfig, build_engine
from minibatch.engine.kv_offload import disk
from minibatch.engine.kv_offload.disk import PromptDiskCache, file_size
from minibatch.engine.models.config import ModelConfig
from minibatch.kernels.kv_types import row_bytes

BS = 16
PROMPT = [(7 * i + 5) % 250 + 3 for i in range(100)]  # six full blocks before its last token
FULL = (len(PROMPT) - 1) // BS


def make(model_dir, folder, **kw):
    cfg = dict(
        model=str(model_dir),
        prompt_cache_gb=0.05,
        prompt_cache_dir=str(folder),
        prompt_cache_min_tokens=BS,
        num_kv_blocks=64,
        max_num_seqs=4,
        speculative="off",
    )
    return build_engine(EngineConfig(**{**cfg, **kw}))


def run(engine, prompt=PROMPT, seed=None, salt=0, n=6):
    params = SamplingParams(temperature=0.0 if seed is None else 0.9, seed=seed, max_tokens=n, ignore_eos=True)
    rid = f"r{time.monotonic_ns()}"
    engine.add_request(rid, prompt, params, cache_salt=salt)
    tokens, final = [], None
    while engine.has_work():
        outs, stats = engine.step()
        for o in outs:
            tokens += o.token_ids
            final = o if o.finished else final
        if stats is None and not outs:
            time.sleep(0.002)  # (a load under way: the daemon's loop waits so too)
    engine.scheduler.blocks.check_integrity()
    engine.tier.flush()
    return tokens, final.metrics


def chain_files(cache_root, engine, prompt=PROMPT, salt=0):
    parent, paths = salt, []
    for i in range(FULL):
        h = block_hash(parent, tuple(prompt[i * BS : (i + 1) * BS]))
        paths.append(cache_root / engine.tier.identity / f"{h:016x}.kv")
        parent = h
    return paths


@pytest.fixture
def folder(tmp_path):
    return tmp_path / "prompt-cache"


def test_a_new_engine_reads_the_prefix_back_and_answers_the_same_greedy_and_seeded(tiny_chat_model_dir, folder):
    first = make(tiny_chat_model_dir, folder)
    greedy, m = run(first)
    seeded, _ = run(first, seed=11)
    assert m.disk_cached_prompt_tokens == 0
    assert first.state().disk_written_blocks >= FULL
    first.close()

    again = make(tiny_chat_model_dir, folder)
    tokens, m = run(again)
    assert tokens == greedy
    assert m.cached_prompt_tokens == m.disk_cached_prompt_tokens == FULL * BS
    assert again.state().disk_hit_blocks == FULL and again.state().disk_read_bytes > 0
    again.close()
    third = make(tiny_chat_model_dir, folder)
    tokens, m = run(third, seed=11)
    assert tokens == seeded and m.disk_cached_prompt_tokens == FULL * BS
    third.close()


@pytest.mark.parametrize("kv_type", ["iq4_nl", "q5_1,q4_0"])
def test_the_4_bit_cache_types_go_to_disk_and_back(builtin_model_dir, folder, kv_type):
    """A block type's bytes are what the disk keeps (iq4_nl's int8 cache too): the next engine's hit answers
    as the first engine computed, and a block's file holds that type's bytes (a head's row of 64 values: iq4_nl
    36, q5_1 48, q4_0 36; f16 128)."""
    first = make(builtin_model_dir, folder, kv_cache_type=kv_type)
    want, _ = run(first)
    assert first.info.kv_cache_type == kv_type
    first.close()
    again = make(builtin_model_dir, folder, kv_cache_type=kv_type)
    tokens, m = run(again)
    assert tokens == want and m.disk_cached_prompt_tokens == FULL * BS
    again.close()
    cfg = ModelConfig.from_dir(builtin_model_dir)
    k_type, _, v_type = kv_type.partition(",")
    assert (
        cfg.head_dim == 64
        and [row_bytes(t, 64) for t in (k_type, v_type or k_type)]
        == {
            "iq4_nl": [36, 36],
            "q5_1,q4_0": [48, 36],
        }[kv_type]
    )
    per_token = sum(row_bytes(t, cfg.head_dim) for t in (k_type, v_type or k_type)) * cfg.num_kv_heads
    payload = file_size(BS, BS * per_token * cfg.num_layers)
    assert {p.stat().st_size for p in chain_files(folder, again)} == {payload}


def test_files_are_private(tiny_chat_model_dir, folder):
    engine = make(tiny_chat_model_dir, folder)
    run(engine)
    engine.close()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    ident = folder / engine.tier.identity
    assert stat.S_IMODE(ident.stat().st_mode) == 0o700
    files = list(ident.iterdir())
    assert len(files) > FULL and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)


@pytest.mark.parametrize(
    "change",
    ["kv_cache_type", "block_size", "weights", "model_file"],
)
def test_anything_that_changes_a_blocks_contents_is_a_miss(tiny_chat_model_dir, folder, tmp_path, change):
    model = tmp_path / "model"
    shutil.copytree(tiny_chat_model_dir, model)
    first = make(model, folder)
    want, _ = run(first)
    first.close()
    kw = {}
    if change == "kv_cache_type":
        kw = {"kv_cache_type": "f16"}
    elif change == "block_size":
        kw = {"block_size": 32, "prompt_cache_min_tokens": 32}
    elif change == "weights":
        kw = {"weights": "q8_0"}
    else:
        weights = next(model.glob("*.safetensors"))
        st = weights.stat()
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    other = make(model, folder, **kw)
    assert other.tier.identity != first.tier.identity
    tokens, m = run(other)
    assert m.disk_cached_prompt_tokens == 0 and other.state().disk_hit_blocks == 0
    if change in ("block_size", "model_file"):
        assert tokens == want  # the same numbers: only the identity moved
    other.close()


@pytest.mark.parametrize("damage", ["truncated", "payload_flip", "token_flip", "too_long", "emptied"])
@pytest.mark.parametrize("which", [0, 3])
def test_a_damaged_file_is_a_miss_removed_and_the_answer_right(tiny_chat_model_dir, folder, caplog, damage, which):
    first = make(tiny_chat_model_dir, folder)
    want, _ = run(first)
    first.close()
    path = chain_files(folder, first)[which]
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "payload_flip":
        data[-100] ^= 0x40
    elif damage == "token_flip":
        data[disk.HEAD.size + 4] ^= 0x01
    elif damage == "too_long":
        data += b"\0" * 16
    else:
        data = bytearray()
    path.write_bytes(bytes(data))

    again = make(tiny_chat_model_dir, folder)
    with caplog.at_level(logging.WARNING, logger="minibatch.prompt_cache"):
        tokens, m = run(again)
    assert tokens == want
    assert m.disk_cached_prompt_tokens == which * BS  # the blocks before it are hits, none after
    assert again.state().disk_bad_blocks == 1
    assert "torn, corrupt" in caplog.text
    again.tier.flush()
    assert path.exists() and path.stat().st_size == file_size(BS, again.tier.io.block_bytes)  # written anew
    again.close()


def test_a_missing_folder_is_a_miss_and_is_made_again(tiny_chat_model_dir, folder):
    first = make(tiny_chat_model_dir, folder)
    want, _ = run(first)
    shutil.rmtree(folder)  # under the running engine: its index still lists the files
    tokens, m = run(first, prompt=[5] + PROMPT[1:])  # another prompt: new blocks are written (the folder anew)
    first.close()
    assert (folder / first.tier.identity).is_dir() and first.state().disk_write_errors == 0
    second = make(tiny_chat_model_dir, folder)
    tokens, m = run(second)
    assert tokens == want and m.disk_cached_prompt_tokens == 0
    second.close()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_disk_that_refuses_writes_is_a_logged_miss(tiny_chat_model_dir, folder, monkeypatch, caplog, code):
    real_open = os.open

    def refusing(path, flags, mode=0o777, **kw):
        if os.path.basename(path).startswith(".tmp-") and not str(path).endswith("model.json"):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, mode, **kw)

    engine = make(tiny_chat_model_dir, folder)
    monkeypatch.setattr(disk.os, "open", refusing)
    with caplog.at_level(logging.WARNING, logger="minibatch.prompt_cache"):
        tokens, m = run(engine)
    assert len(tokens) == 6 and m.output_tokens == 6
    st = engine.state()
    assert st.disk_write_errors >= FULL and st.disk_written_blocks == 0
    assert ("disk is full" if code == errno.ENOSPC else "cannot write") in caplog.text
    assert caplog.text.count("cannot write") == 1  # once a minute, not once a block
    engine.close()


def test_the_folder_never_exceeds_its_budget_and_keeps_the_recently_used(tmp_path):
    payload = os.urandom(1000)
    size = file_size(4, len(payload))
    cache = PromptDiskCache(tmp_path, budget_bytes=10 * size)
    ident = "ab" * 16
    keys = [BlockKey(i + 1, 0, (i, i, i, i)) for i in range(50)]
    for i, key in enumerate(keys):
        cache.write(ident, key, payload)
        if i == 5:
            assert cache.read(ident, keys[0], len(payload)) is not None  # used: the last to go
        on_disk = sum(f.stat().st_size for f in (tmp_path / ident).glob("*.kv"))
        assert on_disk == cache.bytes <= cache.budget
    assert cache.has(ident, keys[0].hash) is False  # 44 newer writes since its use
    cache2 = PromptDiskCache(tmp_path, budget_bytes=10 * size)  # a restart: the same index from the folder
    assert [h for (_, h) in cache2._files] == [h for (_, h) in cache._files]
    cache3 = PromptDiskCache(tmp_path, budget_bytes=3 * size)  # a smaller budget: the oldest go at start
    assert cache3.bytes == 3 * size and cache3.evicted_blocks == 7


def test_an_engine_under_distinct_prefixes_keeps_the_folder_within_its_budget(tiny_chat_model_dir, folder):
    engine = make(tiny_chat_model_dir, folder, prompt_cache_gb=40 * 2**10 / 2**30)  # 40 KiB: a handful of blocks
    budget = 40 * 2**10
    for k in range(6):
        run(engine, prompt=[(k * 13 + i) % 250 + 3 for i in range(90)], n=2)
        on_disk = sum(f.stat().st_size for f in folder.rglob("*.kv"))
        assert on_disk <= budget
    assert engine.tier.cache.evicted_blocks > 0
    engine.close()


def test_block_io_numpy_and_torch_paths_agree():
    from minibatch.engine.runner.kv_cache import KVBlockIO
    from minibatch.kernels.kv_types import PagedKV

    torch.manual_seed(0)
    caches = [
        PagedKV(torch.randn(8, 4, 2, 16), torch.randint(0, 255, (8, 4, 2, 34), dtype=torch.uint8)) for _ in range(3)
    ]
    fast, slow = KVBlockIO(caches), KVBlockIO(caches, numpy_views=False)
    assert fast.read([3, 5]) == slow.read([3, 5])
    payload = fast.read([3])[0]
    slow.write(6, memoryview(payload))
    fast.write(7, memoryview(payload))
    assert fast.read([6, 7]) == [payload, payload]
    with pytest.raises(ValueError, match="bytes"):
        fast.write(1, memoryview(payload[:-1]))


def test_block_io_on_the_pools_layout_copies_a_block_as_two_strided_views(tiny_chat_model_dir):
    from minibatch.engine.models.config import ModelConfig
    from minibatch.engine.runner.kv_cache import KVBlockIO, allocate_kv_cache
    from minibatch.kernels.kv_types import KVCacheTypes

    cfg = ModelConfig.from_dir(tiny_chat_model_dir)
    caches = allocate_kv_cache(cfg, 8, 4, KVCacheTypes("f16", "f32"))
    torch.manual_seed(1)
    for kv in caches:
        kv.k.copy_(torch.randn(kv.k.shape))
        kv.v.copy_(torch.randn(kv.v.shape))
    fast, slow = KVBlockIO(caches), KVBlockIO(caches, numpy_views=False)
    assert fast.strided is not None and fast.strided[0].shape[1] == cfg.num_layers
    assert fast.read([2, 6, 1]) == slow.read([2, 6, 1])
    payload = slow.read([5])[0]
    fast.write(3, memoryview(payload))
    assert slow.read([3]) == [payload]
    assert all(torch.equal(kv.k[3], kv.k[5]) and torch.equal(kv.v[3], kv.v[5]) for kv in caches)

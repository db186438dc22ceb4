"""CUDA-graph bookkeeping (capture sizes, padding, static decode inputs) and a padded batch through the Triton path.

On a GPU everything runs on the device; without one, on CPU with Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

from minibatch.engine.attention.metadata import build_flat_batch
from minibatch.engine.runner.cuda_graphs import DecodeInputs, capture_sizes, padded_size
from tests.kernels.conftest import skip_if_gpu_unusable

# The Triton path runs where the GPU path would: on the GPU when there is one (on CPU, the interpreter).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
skip_if_gpu_unusable()


def test_capture_sizes_cover_every_batch_with_less_than_8_rows_of_padding():
    sizes = capture_sizes(64)
    assert sizes == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20] and capture_sizes(1) == [1]
    for n in range(1, 65):
        s = padded_size(n, sizes)
        assert s >= n and s - n < 8
    assert padded_size(65, sizes) is None  # larger batches run eagerly


def test_decode_inputs_pad_with_the_null_block_and_rewrite_only_changed_rows():
    tables = [[3, 4], [7, 8], [9]]
    batch = build_flat_batch([[11], [12], [13]], [5, 17, 0], tables, 16, DEVICE)
    inp = DecodeInputs(8, max_blocks=4, device=DEVICE)
    assert inp.fill(batch) == 3
    assert inp.input_ids.tolist() == [11, 12, 13, 0, 0, 0, 0, 0]
    assert inp.positions.tolist() == [5, 17, 0, 0, 0, 0, 0, 0]
    assert inp.slot_mapping.tolist() == [3 * 16 + 5, 8 * 16 + 1, 9 * 16, -1, -1, -1, -1, -1]
    assert inp.seq_lens.tolist() == [6, 18, 1, 1, 1, 1, 1, 1]
    # each row holds its request's block list (entries past the context are never read)
    assert [row[: len(t)] for row, t in zip(inp.block_tables[:3].tolist(), tables)] == tables
    assert inp.block_tables[3:, 0].eq(0).all() and inp.query_start_loc.tolist() == list(range(9))
    assert inp.rows_written == 3
    # the next decode step of the same requests: same block lists, no row rewritten
    inp.fill(build_flat_batch([[14], [15], [16]], [6, 18, 1], tables, 16, DEVICE))
    assert inp.rows_written == 3 and inp.seq_lens.tolist()[:4] == [7, 19, 2, 1]
    # the block manager hands out a new list when it allocates: only that row is rewritten
    tables = [tables[0], [7, 8, 10], tables[2]]
    inp.fill(build_flat_batch([[17], [18], [19]], [7, 32, 2], tables, 16, DEVICE))
    assert inp.rows_written == 4 and inp.block_tables[1, :3].tolist() == [7, 8, 10]
    assert inp.slot_mapping.tolist()[:3] == [3 * 16 + 7, 10 * 16, 9 * 16 + 2]
    # refilling with fewer rows leaves no stale rows behind: they turn into padding
    inp.fill(build_flat_batch([[21]], [2], [[5]], 16, DEVICE))
    assert inp.input_ids.tolist()[:3] == [21, 0, 0] and inp.slot_mapping.tolist()[:3] == [5 * 16 + 2, -1, -1]
    assert inp.block_tables[:3, 0].tolist() == [5, 0, 0] and inp.seq_lens.tolist()[:3] == [3, 1, 1]


def test_padding_rows_are_harmless_on_the_triton_path(tiny_llama_dir):
    """A padded decode batch through the real kernels (compiled on a GPU, the interpreter on CPU): real rows
    unchanged, cache untouched by padding."""
    from minibatch.engine.attention.metadata import AttentionMetadata
    from minibatch.engine.attention.triton_backend import TritonAttentionBackend, TritonPlan
    from minibatch.engine.models.ops import TritonOps
    from minibatch.engine.runner.kv_cache import allocate_kv_cache
    from minibatch.engine.weights.loader import load_model

    model = load_model(tiny_llama_dir, TritonAttentionBackend(), device=DEVICE, packed=False, ops=TritonOps())
    caches = allocate_kv_cache(model.config, 6, 8, device=DEVICE)
    prompt = build_flat_batch([[5, 6, 7]], [0], [[2]], 8, DEVICE)
    with torch.no_grad():
        model(prompt.input_ids, prompt.positions, caches, prompt.attn)
        step = build_flat_batch([[9]], [3], [[2]], 8, DEVICE)
        eager = model.compute_logits(model(step.input_ids, step.positions, [c.clone() for c in caches], step.attn))
        inp = DecodeInputs(4, max_blocks=2, device=DEVICE)
        inp.fill(step)
        meta = AttentionMetadata([1] * 4, [1] * 4, 8, inp.slot_mapping, [[0]] * 4)
        meta.plan = TritonPlan(inp.block_tables, inp.query_start_loc, inp.seq_lens, 1, 1, 2 * 8)
        before_null = [t[0].clone() for t in caches[0]]  # the null block of K and V
        padded = model.compute_logits(model.forward_planned(inp.input_ids, inp.positions, caches, meta))
    torch.testing.assert_close(padded[:1], eager, atol=1e-5, rtol=1e-5)
    assert all(
        torch.equal(t[0], b) for t, b in zip(caches[0], before_null)
    )  # padding rows wrote nothing (negative slots)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_graph_replay_equals_eager_decode(tiny_llama_dir, tmp_path, kind):
    """Three sequences prefilled, then one decode step: by replay of the size-4 graph and eagerly (Gemma 2:
    per-layer windows and capped scores inside the graph)."""
    from minibatch.engine.attention.triton_backend import TritonAttentionBackend
    from minibatch.engine.models.ops import TritonOps
    from minibatch.engine.runner.cuda_graphs import DecodeGraphs
    from minibatch.engine.runner.kv_cache import allocate_kv_cache
    from minibatch.engine.weights.loader import load_model
    from tests.engine.test_families import _save

    model = load_model(
        tiny_llama_dir if kind == "llama" else _save(kind, tmp_path / kind),
        TritonAttentionBackend(),
        device="cuda",
        packed=False,
        ops=TritonOps(),
    )
    caches = allocate_kv_cache(model.config, 32, 8, device="cuda")
    tables = [[1, 2], [3, 4], [5, 6]]
    with torch.no_grad():
        pre = build_flat_batch([[5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18]], [0, 0, 0], tables, 8, "cuda")
        model(pre.input_ids, pre.positions, caches, pre.attn)
        step = build_flat_batch([[20], [21], [22]], [3, 2, 9], tables, 8, "cuda")
        eager = model.compute_logits(model(step.input_ids, step.positions, [c.clone() for c in caches], step.attn))
        graphs = DecodeGraphs(model, caches, 8, max_model_len=16, max_num_seqs=4)
        graphs.capture()
        replayed = graphs.run(step)
    assert replayed is not None and replayed.shape == eager.shape
    torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_graph_inputs_carry_per_layer_windows_and_soft_capping(tmp_path, kind):
    """What a captured decode runs for Gemma (a window on some layers, Gemma 2's capped scores), from the
    static graph inputs, equals the eager decode; past the window, so the window matters."""
    from minibatch.engine.attention.triton_backend import TritonAttentionBackend
    from minibatch.engine.models.ops import TritonOps
    from minibatch.engine.runner.cuda_graphs import DecodeGraphs
    from minibatch.engine.runner.kv_cache import allocate_kv_cache
    from minibatch.engine.weights.loader import load_model
    from tests.engine.test_families import _save

    model = load_model(
        _save(kind, tmp_path / kind), TritonAttentionBackend(), device=DEVICE, packed=False, ops=TritonOps()
    )
    caches = allocate_kv_cache(model.config, 8, 8, device=DEVICE)
    tables = [[1, 2, 3], [4, 5, 6]]
    with torch.no_grad():
        pre = build_flat_batch([list(range(5, 24)), list(range(30, 41))], [0, 0], tables, 8, DEVICE)
        model(pre.input_ids, pre.positions, caches, pre.attn)
        step = build_flat_batch([[20], [21]], [19, 11], tables, 8, DEVICE)
        eager = model.compute_logits(model(step.input_ids, step.positions, [c.clone() for c in caches], step.attn))
        graphs = DecodeGraphs(model, caches, 8, max_model_len=24, max_num_seqs=2)
        inp = DecodeInputs(2, max_blocks=3, device=DEVICE)
        inp.fill(step)
        meta = graphs._meta(inp, 2)
        assert set(meta.plans) == set(model.config.layer_windows) and meta.softcap == model.config.attn_softcap
        static = model.compute_logits(model.forward_planned(inp.input_ids, inp.positions, caches, meta))
    torch.testing.assert_close(static, eager, atol=1e-5, rtol=1e-5)

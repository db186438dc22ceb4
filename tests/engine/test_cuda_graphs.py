"""CUDA-graph bookkeeping that needs no GPU: capture sizes, padding to them, static decode inputs."""

from __future__ import annotations

import torch

from minibatch.engine.attention import build_flat_batch
from minibatch.engine.cuda_graphs import DecodeInputs, capture_sizes, padded_size


def test_capture_sizes_cover_every_batch_with_less_than_8_rows_of_padding():
    sizes = capture_sizes(64)
    assert sizes == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20] and capture_sizes(1) == [1]
    for n in range(1, 65):
        s = padded_size(n, sizes)
        assert s >= n and s - n < 8
    assert padded_size(65, sizes) is None  # larger batches run eagerly


def test_decode_inputs_pad_with_the_null_block():
    batch = build_flat_batch([[11], [12], [13]], [5, 17, 0], [[3, 4], [7, 8], [9]], 16)
    inp = DecodeInputs.empty(8, max_blocks=4, device="cpu")
    assert inp.fill(batch) == 3
    assert inp.input_ids.tolist() == [11, 12, 13, 0, 0, 0, 0, 0]
    assert inp.positions.tolist() == [5, 17, 0, 0, 0, 0, 0, 0]
    assert inp.slot_mapping.tolist() == [3 * 16 + 5, 8 * 16 + 1, 9 * 16, -1, -1, -1, -1, -1]
    assert inp.seq_lens.tolist() == [6, 18, 1, 1, 1, 1, 1, 1]
    assert inp.block_tables[:3].tolist() == [[3, 0, 0, 0], [7, 8, 0, 0], [9, 0, 0, 0]]
    assert inp.block_tables[3:].eq(0).all() and inp.query_start_loc.tolist() == list(range(9))
    # refilling with fewer rows leaves no stale rows behind
    inp.fill(build_flat_batch([[21]], [2], [[5]], 16))
    assert inp.input_ids.tolist()[:2] == [21, 0] and inp.slot_mapping.tolist()[:2] == [5 * 16 + 2, -1]
    assert inp.block_tables[1].eq(0).all() and inp.seq_lens.tolist()[:2] == [3, 1]


def test_padding_rows_are_harmless_on_the_triton_path(tiny_llama_dir):
    """A padded decode batch through the real kernels (interpreter on CPU): real rows unchanged, cache untouched by padding."""
    from minibatch.engine.kv_cache import allocate_kv_cache
    from minibatch.engine.weights import load_model
    from minibatch.engine.models.ops import TritonOps
    from minibatch.engine.triton_backend import TritonAttentionBackend, _TritonPlan
    from minibatch.engine.attention import AttentionMetadata

    model = load_model(tiny_llama_dir, TritonAttentionBackend(), packed=False, ops=TritonOps())
    caches = allocate_kv_cache(model.config, 6, 8)
    prompt = build_flat_batch([[5, 6, 7]], [0], [[2]], 8)
    with torch.no_grad():
        model(prompt.input_ids, prompt.positions, caches, prompt.attn)
        step = build_flat_batch([[9]], [3], [[2]], 8)
        eager = model.compute_logits(model(step.input_ids, step.positions, [c.clone() for c in caches], step.attn))
        inp = DecodeInputs.empty(4, max_blocks=2, device="cpu")
        inp.fill(step)
        meta = AttentionMetadata([1] * 4, [1] * 4, 8, inp.slot_mapping, [[0]] * 4)
        meta.plan = _TritonPlan(inp.block_tables, inp.query_start_loc, inp.seq_lens, 1)
        before_null = caches[0][:, 0].clone()
        padded = model.compute_logits(model.forward_planned(inp.input_ids, inp.positions, caches, meta))
    torch.testing.assert_close(padded[:1], eager, atol=1e-5, rtol=1e-5)
    assert torch.equal(caches[0][:, 0], before_null)  # padding rows wrote nothing (negative slots)

"""Our paged-cache forward against the Hugging Face model, logits within 1e-4 in fp32."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from minibatch.engine.attention.metadata import build_flat_batch
from minibatch.engine.attention.torch_backend import TorchAttentionBackend
from minibatch.engine.runner.kv_cache import allocate_kv_cache
from minibatch.engine.weights.loader import load_model

BLOCK_SIZE = 4
PROMPT_LENS = (5, 11, 2)
DECODE_STEPS = 10


def _hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()  # [len, vocab]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_packed_prefill_then_decode_matches_hf(kind, tiny_llama_dir, tiny_qwen2_dir):
    model_dir = tiny_llama_dir if kind == "llama" else tiny_qwen2_dir
    ours = load_model(model_dir, TorchAttentionBackend())
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = random.Random(7)
    vocab = ours.config.vocab_size
    seqs = [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENS]

    # Shuffled, non-contiguous block tables: each sequence gets blocks scattered over the pool.
    total = len(PROMPT_LENS) * -(-(max(PROMPT_LENS) + DECODE_STEPS) // BLOCK_SIZE)
    pool = list(range(total + 5))
    rng.shuffle(pool)
    per_seq = total // len(PROMPT_LENS)
    tables = [pool[i * per_seq : (i + 1) * per_seq] for i in range(len(seqs))]
    assert any(t != sorted(t) or t[-1] - t[0] != len(t) - 1 for t in tables)
    caches = allocate_kv_cache(ours.config, len(pool), BLOCK_SIZE)

    # Prefill: all three prompts packed in one flat batch; compare every position's logits.
    batch = build_flat_batch(seqs, [0] * len(seqs), tables, BLOCK_SIZE)
    with torch.no_grad():
        logits = ours.compute_logits(ours(batch.input_ids, batch.positions, caches, batch.attn))
    start = 0
    for ids in seqs:
        ref = _hf_logits(hf, ids)
        torch.testing.assert_close(logits[start : start + len(ids)], ref, atol=1e-4, rtol=0)
        start += len(ids)

    # Decode: one token per sequence per step, fed the reference's greedy choice.
    for _ in range(DECODE_STEPS):
        next_tokens = [int(_hf_logits(hf, ids)[-1].argmax()) for ids in seqs]
        batch = build_flat_batch([[t] for t in next_tokens], [len(s) for s in seqs], tables, BLOCK_SIZE)
        with torch.no_grad():
            step_logits = ours.compute_logits(ours(batch.input_ids, batch.positions, caches, batch.attn))
        for i, tok in enumerate(next_tokens):
            seqs[i].append(tok)
            torch.testing.assert_close(step_logits[i], _hf_logits(hf, seqs[i])[-1], atol=1e-4, rtol=0)


def test_chunked_prefill_over_cached_context_matches_hf(tiny_llama_dir):
    """A prompt prefilled in two chunks (the second attends to the first from the cache)."""
    ours = load_model(tiny_llama_dir, TorchAttentionBackend())
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = list(range(3, 40))
    table = [6, 2, 9, 0, 4, 7, 1, 8, 3, 5]
    caches = allocate_kv_cache(ours.config, 10, BLOCK_SIZE)
    outs = []
    for start, end in ((0, 13), (13, 37)):
        b = build_flat_batch([ids[start:end]], [start], [table], BLOCK_SIZE)
        with torch.no_grad():
            outs.append(ours.compute_logits(ours(b.input_ids, b.positions, caches, b.attn)))
    torch.testing.assert_close(torch.cat(outs), _hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_prefill_and_decode_with_the_cpu_kernel_match_hf(tiny_llama_dir):
    from minibatch.kernels.cpu.paged_attention import load_extension, store_and_attention

    if load_extension() is None:
        pytest.skip("the C++ extension cannot be built here")
    ours = load_model(tiny_llama_dir, TorchAttentionBackend(store_and_attention))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    seqs = [list(range(3, 3 + n)) for n in (9, 21, 4)]
    tables = [[5, 1, 9, 12], [2, 7, 11, 3, 8, 0 + 13, 14], [4, 6, 10]]
    caches = allocate_kv_cache(ours.config, 16, BLOCK_SIZE)
    batch = build_flat_batch(seqs, [0, 0, 0], tables, BLOCK_SIZE)
    with torch.no_grad():
        ours(batch.input_ids, batch.positions, caches, batch.attn)
    for _ in range(5):
        nxt = [int(_hf_logits(hf, s)[-1].argmax()) for s in seqs]
        batch = build_flat_batch([[t] for t in nxt], [len(s) for s in seqs], tables, BLOCK_SIZE)
        with torch.no_grad():
            logits = ours.compute_logits(ours(batch.input_ids, batch.positions, caches, batch.attn))
        for i, t in enumerate(nxt):
            seqs[i].append(t)
            torch.testing.assert_close(logits[i], _hf_logits(hf, seqs[i])[-1], atol=1e-4, rtol=0)

"""A minimal greedy driver over the paged-cache forward: prefill all prompts packed, then decode together.

The scheduler-driven engine supersedes this for serving; it stays as the
smallest end-to-end use of the model forward, for tests and quick checks.
"""

from __future__ import annotations

import torch

from minibatch.engine.attention.metadata import build_flat_batch
from minibatch.engine.models.llama import LlamaForCausalLM
from minibatch.engine.runner.kv_cache import allocate_kv_cache
from minibatch.kernels.kv_types import KVCacheTypes


@torch.inference_mode()
def greedy_generate(
    model: LlamaForCausalLM,
    prompts: list[list[int]],
    max_new_tokens: int | list[int],
    eos_token_ids: tuple[int, ...] = (),
    block_size: int = 16,
) -> list[list[int]]:
    """Generate greedily for every prompt in one batch; each stops at its own limit or at EOS."""
    n = len(prompts)
    limits = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    # Give every sequence the blocks it can ever need, laid out one after another.
    tables, next_block = [], 0
    for prompt, limit in zip(prompts, limits, strict=True):
        need = -(-(len(prompt) + limit) // block_size)
        tables.append(list(range(next_block, next_block + need)))
        next_block += need
    caches = allocate_kv_cache(model.config, next_block, block_size, KVCacheTypes.of_dtype(dtype), device)

    outputs: list[list[int]] = [[] for _ in range(n)]
    active = [i for i in range(n) if limits[i] > 0]
    chunks = {i: list(prompts[i]) for i in active}
    cached = {i: 0 for i in active}
    while active:
        batch = build_flat_batch(
            [chunks[i] for i in active], [cached[i] for i in active], [tables[i] for i in active], block_size, device
        )
        hidden = model(batch.input_ids, batch.positions, caches, batch.attn)
        next_ids = model.compute_logits(hidden[batch.logits_indices]).argmax(dim=-1).tolist()
        still = []
        for i, tok in zip(active, next_ids):
            cached[i] += len(chunks[i])
            outputs[i].append(tok)
            chunks[i] = [tok]
            if len(outputs[i]) < limits[i] and tok not in eos_token_ids:
                still.append(i)
        active = still
    return outputs

"""The built-in SmolLM2-135M-Instruct: our batched greedy output equals HF generate, token for token."""

from __future__ import annotations

import pytest
import torch
import transformers

from minibatch.engine.attention.torch_backend import TorchAttentionBackend
from minibatch.engine.testing.greedy import greedy_generate
from minibatch.engine.weights.loader import load_model
from minibatch.engine.weights.reference import load_hf_reference

pytestmark = pytest.mark.model

CHATS = [
    "Hi!",
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea, the wind and a lighthouse keeper who waits for a ship "
    "that never comes back. Use vivid imagery and end with a hopeful line.",
    "Explain, step by step and with a small worked example, how binary search finds a number in a "
    "sorted list of one thousand integers, why it needs at most about ten comparisons, what happens "
    "when the number is missing, and which mistakes beginners make with the midpoint and the loop bounds.",
]
NEW_TOKENS = 64


def test_batched_greedy_equals_hf_generate_one_by_one(builtin_model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(builtin_model_dir)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True)
        for c in CHATS
    ]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    lengths = [len(p) for p in prompts]
    assert lengths == sorted(lengths) and lengths[-1] > 2 * lengths[0], lengths

    hf = load_hf_reference(builtin_model_dir)
    # No EOS stop on either side, so every prompt yields all 64 tokens (past an
    # end-of-turn token the model simply goes on).
    config = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=tok.eos_token_id
    )
    hf.generation_config.eos_token_id = None
    expected = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), generation_config=config
            )
        expected.append(out[0, len(p) :].tolist())
        assert len(expected[-1]) == NEW_TOKENS

    ours = load_model(builtin_model_dir, TorchAttentionBackend(), weights="native-exact")  # the exact path: HF parity
    got = greedy_generate(ours, prompts, NEW_TOKENS, eos_token_ids=(), block_size=16)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, (
            f"prompt {i}: first difference at token {next(j for j, (a, b) in enumerate(zip(g, e)) if a != b)}"
        )

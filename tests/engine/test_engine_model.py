"""The engine with the built-in model: greedy output equals HF generate alone, in every situation."""

from __future__ import annotations

import pytest
import torch
import transformers

from minibatch.engine.core.sampling_params import SamplingParams
from minibatch.engine.factory import EngineConfig, build_engine
from minibatch.engine.weights.reference import load_hf_reference

pytestmark = pytest.mark.model

QUESTIONS = [
    "Hi!",
    "What is 7 times 8?",
    "Name three primary colors.",
    "Write a haiku about autumn leaves falling in a quiet park.",
    "Explain what a hash table is to a ten year old, with an example about a library.",
    "Translate 'good morning, how are you today?' into French and Spanish.",
    "List the planets of the solar system in order from the sun.",
    "Why is the sky blue? Keep it short.",
    "Give me a recipe for pancakes with the amounts for four people and the steps in order, "
    "including how hot the pan should be and how to know when to flip them.",
    "What is the capital of Japan?",
    "Write a limerick about a cat who learned to code in Python and then refused to catch mice.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How do I reverse a list in Python?",
    "Describe the water cycle, covering evaporation, condensation, precipitation and collection, "
    "and say which part of it is driven by the sun and which by gravity.",
    "Tell me a fun fact about octopuses.",
    "What should I pack for a three day hiking trip in the mountains in early spring?",
]
MAX_TOKENS = [12, 40, 24, 33, 48, 17, 29, 8, 44, 21, 36, 15, 27, 41, 10, 32]


@pytest.fixture(scope="module")
def tokenizer(builtin_model_dir):
    return transformers.AutoTokenizer.from_pretrained(builtin_model_dir)


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [chat_ids(tokenizer, q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_reference(builtin_model_dir, prompts) -> list[list[int]]:
    """HF generate(do_sample=False) for each prompt alone, EOS not stopping (as ignore_eos)."""
    hf = load_hf_reference(builtin_model_dir)
    hf.generation_config.eos_token_id = None
    out = []
    for p, n in zip(prompts, MAX_TOKENS):
        with torch.no_grad():
            ids = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=n,
                pad_token_id=2,
            )
        out.append(ids[0, len(p) :].tolist())
    return out


def run_staggered(engine, prompts, max_tokens, every=3, per_wave=4):
    """Submit `per_wave` requests every `every` steps; step until all finish; check blocks each step."""
    reqs, pending = [], list(range(len(prompts)))
    step = 0
    while pending or engine.has_work():
        if pending and step % every == 0:
            for i in pending[:per_wave]:
                reqs.append(
                    engine.add_request(
                        f"r{i}", prompts[i], SamplingParams(temperature=0, max_tokens=max_tokens[i], ignore_eos=True)
                    )
                )
            pending = pending[per_wave:]
        engine.step()
        engine.scheduler.blocks.check_integrity()
        step += 1
    assert engine.scheduler.blocks.num_used_blocks == 0
    return {r.request_id: r for r in reqs}


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize(
    "mode,num_blocks",
    [("continuous", None), ("continuous", 20), ("static", None)],
    ids=["continuous", "continuous-preempting", "static"],
)
def test_staggered_mixed_batch_equals_hf_alone(mode, num_blocks, prompts, hf_reference):
    engine = build_engine(
        EngineConfig(
            dtype="float32",
            weights="native-exact",
            mode=mode,
            max_num_seqs=8,
            max_num_batched_tokens=128,
            num_kv_blocks=num_blocks or 400,
            max_wait_ms=0,
        )
    )
    reqs = run_staggered(engine, prompts, MAX_TOKENS)
    for i, expected in enumerate(hf_reference):
        got = reqs[f"r{i}"].output_token_ids
        assert got == expected, f"request {i}: first difference at token {first_diff(got, expected)}"
    if num_blocks:
        assert engine.scheduler.num_preemptions > 0
    if mode == "static":
        assert engine.scheduler.wasted_row_steps > 0


def test_second_turn_reuses_the_cached_history(builtin_model_dir, tokenizer):
    engine = build_engine(EngineConfig(dtype="float32", max_num_seqs=4, num_kv_blocks=200))
    turn1 = [{"role": "user", "content": "My name is Ada and I like chess. Please remember it."}]
    ids1 = tokenizer.apply_chat_template(turn1, add_generation_prompt=True, tokenize=True)
    ids1 = list(ids1["input_ids"]) if hasattr(ids1, "keys") else list(ids1)
    first = engine.add_request("t1", ids1, SamplingParams(temperature=0, max_tokens=24))
    while engine.has_work():
        engine.step()
    answer = tokenizer.decode(first.output_token_ids, skip_special_tokens=True)
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "What is my name?"}]
    ids2 = tokenizer.apply_chat_template(turn2, add_generation_prompt=True, tokenize=True)
    ids2 = list(ids2["input_ids"]) if hasattr(ids2, "keys") else list(ids2)
    second = engine.add_request("t2", ids2, SamplingParams(temperature=0, max_tokens=16))
    while engine.has_work():
        engine.step()
    assert second.num_cached_tokens >= 32 and engine.scheduler.blocks.prefix_hits > 0

    cold = build_engine(EngineConfig(dtype="float32", max_num_seqs=4, num_kv_blocks=200, enable_prefix_caching=False))
    again = cold.add_request("t2", ids2, SamplingParams(temperature=0, max_tokens=16))
    while cold.has_work():
        cold.step()
    assert again.num_cached_tokens == 0
    assert second.output_token_ids == again.output_token_ids


def test_seeded_sampling_is_batch_invariant(prompts):
    engine = build_engine(EngineConfig(dtype="float32", max_num_seqs=8, num_kv_blocks=300))
    params = dict(temperature=0.9, top_p=0.9, top_k=50, max_tokens=20, ignore_eos=True, seed=1234)
    alone = engine.add_request("alone", prompts[3], SamplingParams(**params))
    while engine.has_work():
        engine.step()
    batch = [
        engine.add_request(f"b{i}", p, SamplingParams(temperature=1.0, max_tokens=20, seed=i))
        for i, p in enumerate(prompts[:5])
    ]
    together = engine.add_request("together", prompts[3], SamplingParams(**params))
    while engine.has_work():
        engine.step()
    assert together.output_token_ids == alone.output_token_ids
    assert len({tuple(r.output_token_ids) for r in batch}) > 1  # they did sample


def test_stop_string_across_tokens_and_multibyte_text(tokenizer, prompts, hf_reference):
    engine = build_engine(EngineConfig(dtype="float32", weights="native-exact", max_num_seqs=4, num_kv_blocks=200))
    # A stop string that straddles a token boundary in the reference output.
    ref = hf_reference[4]
    text = tokenizer.decode(ref, skip_special_tokens=True)
    pieces = [tokenizer.decode(ref[:k], skip_special_tokens=True) for k in range(len(ref) + 1)]
    k = next(
        k
        for k in range(3, len(ref))
        if len(pieces[k]) - len(pieces[k - 1]) >= 2 and len(pieces[k + 1]) - len(pieces[k]) >= 2
    )
    stop = text[len(pieces[k]) - 2 : len(pieces[k]) + 2]  # last 2 chars of token k-1 + first 2 of token k
    assert stop not in text[: len(pieces[k]) - 2]
    r = engine.add_request(
        "stop", prompts[4], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop=[stop])
    )
    texts = []
    while engine.has_work():
        outs, _ = engine.step()
        texts += [o.text for o in outs if o.request_id == "stop"]
    assert "".join(texts) == text[: text.index(stop)] and r.status.finish_reason == "stop"

    # Multi-byte output: emoji and CJK, several tokens per character, streamed token by token.
    for k, raw in enumerate(["Emoji list: 😀 😃 😄 😁 😆", "你好，世界。你好，世界。你好，"]):
        m = engine.add_request(f"mb{k}", tokenizer.encode(raw), SamplingParams(temperature=0, max_tokens=15))
        chunks = []
        while engine.has_work():
            outs, _ = engine.step()
            chunks += [o.text for o in outs if o.request_id == f"mb{k}"]
        joined = "".join(chunks)
        assert joined == tokenizer.decode(m.output_token_ids, skip_special_tokens=True)
        assert any(ord(c) > 0x2E80 and c != "\ufffd" for c in joined), joined
        # only the last delta (cut by max_tokens) may end in an incomplete character
        assert all("\ufffd" not in c for c in chunks[:-1]), chunks

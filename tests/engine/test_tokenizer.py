"""The daemon's tokenizer loads plain fast tokenizers without AutoTokenizer, and says the same as it."""

from __future__ import annotations

import pytest
import transformers

from minibatch.engine.tokenizer import TextTokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colors, ünïcode ✓."}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c\n\n  d"}],
]


@pytest.mark.model
def test_builtin_tokenizer_equals_autotokenizer(builtin_model_dir):
    ours = TextTokenizer(builtin_model_dir)
    assert type(ours.hf) is transformers.PreTrainedTokenizerFast or type(ours.hf).__name__ == "TokenizersBackend"
    ref = transformers.AutoTokenizer.from_pretrained(builtin_model_dir)
    assert ours.eos_token_id == ref.eos_token_id and ours.has_chat_template
    for messages in CONVERSATIONS:
        want = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        want = list(want["input_ids"]) if hasattr(want, "keys") else list(want)
        assert ours.chat(messages) == want
    text = "Paris is the capital of France. Ça va? 東京 🙂"
    ids = ours.encode(text)
    assert ids == list(ref.encode(text, add_special_tokens=False))
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True) == text

"""The daemon's tokenizer runs plain tokenizer.json files on `tokenizers` + jinja2.

It says exactly what transformers says.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import transformers

from minibatch.engine.text.tokenizer import TextTokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colors, ünïcode ✓."}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c\n\n  d"}],
    [{"role": "user", "content": "  leading and trailing  \n"}, {"role": "assistant", "content": "<|im_end|> in text"}],
]

TEXTS = [
    "Paris is the capital of France. Ça va? 東京 🙂",
    "  two leading spaces, tabs\tand\r\nnewlines\n\n\n",
    "numbers 1234567890 3.14159 -42 1e-9 0x1F",
    "code: def f(x):\n    return {'a': [1, 2]}  # comment",
    "special tokens in text: <|im_start|>user\nhi<|im_end|> <|endoftext|>",
    "emoji 👩‍👩‍👧 and combining é and RTL שלום and ZWJ\u200d",
    "",
    " ",
]

# A template using what real ones do: namespace, loop controls, tojson, raise_exception, reasoning fields,
# the {% generation %} tag, the special tokens transformers passes by name.
TEMPLATE = """{{ bos_token }}{%- set ns = namespace(sys=false, n=0) %}
{%- for m in messages %}
  {%- if m.role == 'system' %}{% set ns.sys = true %}{% endif %}
  {%- if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}
  {%- if m.role == 'skip' %}{% continue %}{% endif %}
  {%- set ns.n = ns.n + 1 %}
<|im_start|>{{ m.role }}
{% if m.role == 'assistant' %}{% generation %}{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content | trim }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}{{ eos_token }}
{%- endfor %}
{{ {'n': ns.n, 'sys': ns.sys, 'text': 'é <b>'} | tojson }}{{ dict(a=1) | tojson(indent=2) }}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def builtin(builtin_model_dir):
    return TextTokenizer(builtin_model_dir), transformers.AutoTokenizer.from_pretrained(builtin_model_dir)


@pytest.mark.model
def test_builtin_runs_on_tokenizers_and_equals_autotokenizer(builtin):
    ours, ref = builtin
    assert ours.backend == "tokenizers"
    assert ours.eos_token_id == ref.eos_token_id == 2 and ours.has_chat_template
    for messages in CONVERSATIONS:
        want = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        want = list(want["input_ids"]) if hasattr(want, "keys") else list(want)
        assert ours.chat(messages) == want
        assert ours.render_chat(messages, add_generation_prompt=False) == ref.apply_chat_template(
            messages, add_generation_prompt=False, tokenize=False
        )
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == list(ref.encode(text, add_special_tokens=False)), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False) == text


@pytest.mark.model
def test_no_token_stands_for_more_bytes_than_max_token_bytes(builtin):
    """The bound the daemon refuses a too-long prompt by before encoding it: every token's decoded text is at
    most max_token_bytes bytes, so a text is at least its bytes / max_token_bytes tokens."""
    ours, _ = builtin
    bound = ours.max_token_bytes
    longest = max(len(ours.decode([i], skip_special_tokens=False).encode()) for i in range(len(ours.vocab())))
    assert 1 < longest <= bound
    for text in [*TEXTS, "word " * 2000, "\u00e9\u4e2d" * 500]:
        assert len(ours.encode(text)) >= len(text.encode()) / bound, text[:20]


@pytest.mark.model
def test_every_token_decodes_as_transformers_decodes_it(builtin):
    """Token by token (what logprobs and the detokenizer do), special tokens kept and skipped."""
    ours, ref = builtin
    vocab = range(ref.vocab_size)
    for skip in (False, True):
        assert [ours.decode([i], skip_special_tokens=skip) for i in vocab] == ref.batch_decode(
            [[i] for i in vocab], skip_special_tokens=skip
        )


@pytest.mark.model
def test_template_features_render_as_transformers_renders_them(builtin_model_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin_model_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    ours, ref = TextTokenizer(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert ours.backend == "tokenizers"
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "  a  ", "reasoning": "why"},
        {"role": "user", "content": "ünï"},
    ]
    for gen in (True, False):
        want = ref.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
        assert ours.render_chat(messages, add_generation_prompt=gen) == want
        assert "<think>why</think>a" in want and '"text": "é <b>"' in want  # the features did render
    with pytest.raises(ValueError, match="chat template refused these messages: bad role tool"):
        ours.chat(messages + [{"role": "tool", "content": "x"}])
    # the sandbox holds: no attribute of a Python internal is reachable
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ messages.__class__ }}"}))
    assert TextTokenizer(tmp_path).render_chat(messages) == ""


@pytest.mark.model
def test_tokenizers_with_behaviour_of_their_own_go_through_transformers(builtin_model_dir, tmp_path):
    for name in ("tokenizer.json", "chat_template.jinja"):
        shutil.copy(builtin_model_dir / name, tmp_path / name)
    config = json.loads((builtin_model_dir / "tokenizer_config.json").read_text())
    # a named special token the file does not mark special: transformers would add it, so it must do the work
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "sep_token": "Hello"}))
    assert TextTokenizer(tmp_path).backend == "transformers"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    fallback = TextTokenizer(tmp_path)
    assert fallback.backend == "transformers"
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert fallback.encode("Hi there") == list(ref.encode("Hi there", add_special_tokens=False))
    assert fallback.chat(CONVERSATIONS[0]) == ref.apply_chat_template(
        CONVERSATIONS[0], add_generation_prompt=True, tokenize=True, return_dict=False
    )


@pytest.mark.model
def test_loading_the_builtin_tokenizer_imports_no_transformers(builtin_model_dir):
    code = (
        "import sys; from minibatch.engine.text.tokenizer import TextTokenizer; "
        f"t = TextTokenizer({str(builtin_model_dir)!r}); t.chat([{{'role': 'user', 'content': 'hi'}}]); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

"""The text side of a model: encode, decode and render chat messages, without exposing transformers.

A model whose tokenizer is a plain `tokenizer.json` (every GGUF we prepare, most hub models) is run on the
`tokenizers` library directly, with the chat template rendered by jinja2 the way transformers renders it:
importing transformers costs about a second and 100 MB at every start. Anything else (a tokenizer class with
behaviour of its own, special tokens the file does not mark) goes through transformers' AutoTokenizer.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from minibatch.engine.text.fim import FIM_CONFIG_KEY, FimTokens

# Tokenizer classes that are exactly the `tokenizers` backend with no behaviour of their own.
_PLAIN_FAST = ("TokenizersBackend", "PreTrainedTokenizerFast")
# The named special tokens transformers hands a chat template (its SPECIAL_TOKENS_ATTRIBUTES).
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# tokenizer_config.json's key for a decoder reranker's prompt (a GGUF's tokenizer.chat_template.rerank): the text
# with {query} and {document} in it, encoded with its special tokens (Qwen3-Reranker's judge prompt)
RERANK_TEMPLATE_KEY = "minibatch_rerank_template"


class TextTokenizer:
    """The model's tokenizer; the daemon and scripts use only these methods and attributes."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self._tok = _plain_tokenizer(model_dir, config)
        if self._tok is not None:
            self.backend = "tokenizers"
            self._special = {k: _token_text(config[k]) for k in _NAMED_SPECIAL if config.get(k) is not None}
            eos = self._special.get("eos_token")
            self.eos_token_id: int | None = self._tok.token_to_id(eos) if eos is not None else None
            self.chat_template = _chat_template(model_dir, config)
        else:
            from transformers import AutoTokenizer

            self.backend = "transformers"
            self.hf = AutoTokenizer.from_pretrained(model_dir)
            self.eos_token_id = self.hf.eos_token_id
            self.chat_template = getattr(self.hf, "chat_template", None)
        self.has_chat_template = bool(self.chat_template)
        self._fim_named = config.get(FIM_CONFIG_KEY)  # a GGUF's own fill-in-the-middle ids (engine/text/fim.py)
        self.rerank_template: str | None = config.get(RERANK_TEMPLATE_KEY)
        self._renders_tools: bool | None = None

    def encode(self, text: str) -> list[int]:
        if self._tok is None:
            return list(self.hf.encode(text, add_special_tokens=False))
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt's ids with the special tokens the tokenizer adds around text (the BOS of Llama 2,
        Mistral, Gemma, Phi-3), as llama.cpp and transformers add them; a chat template writes its own."""
        if self._tok is None:
            return list(self.hf.encode(text, add_special_tokens=True))
        return self._tok.encode(text, add_special_tokens=True).ids

    def encode_pair(self, first: str, second: str) -> list[int]:
        """Two texts as one input with the special tokens the tokenizer puts around and between a pair (a
        cross-encoder's query and document: BERT's [CLS] q [SEP] d [SEP], XLM-R's <s> q </s></s> d </s>); a
        decoder reranker's: its rerank prompt with the query and the document in their places."""
        if self.rerank_template is not None:
            return self.encode(self.rerank_template.replace("{query}", first).replace("{document}", second))
        if self._tok is None:
            return list(self.hf.encode(first, second, add_special_tokens=True))
        return self._tok.encode(first, second, add_special_tokens=True).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._tok is None:
            return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_texts(self, size: int) -> list[str]:
        """Each of the first `size` ids' text alone (a partial UTF-8 character as U+FFFD; ids past the
        tokenizer's vocabulary as ""): what DRY's sequence breakers are matched against."""
        known = len(self.vocab())
        ids = [[i] for i in range(min(size, known))]
        if self._tok is not None:
            texts = self._tok.decode_batch(ids, skip_special_tokens=False)
        else:
            texts = self.hf.batch_decode(ids, skip_special_tokens=False)
        return list(texts) + [""] * (size - len(texts))

    @functools.cached_property
    def fim(self) -> FimTokens | None:
        """The model's fill-in-the-middle markers (engine/text/fim.py), or None when it has none."""
        return FimTokens.of(self.vocab(), self._fim_named if isinstance(self._fim_named, dict) else None)

    @functools.cached_property
    def added_bos(self) -> int | None:
        """The token the tokenizer puts before a raw prompt's text (Llama 2's BOS), or None."""
        plain, added = self.encode("a"), self.encode_prompt("a")
        return added[0] if len(added) == len(plain) + 1 and added[1:] == plain else None

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token can stand for, bounded from above by the longest token's own text
        in UTF-8 (a byte-level token writes each byte as one or two characters, SentencePiece's a space as the
        3-byte U+2581, a byte-fallback token as `<0xNN>`): a text of B bytes is at least B / this many
        tokens, which refuses a prompt far past the context without encoding it."""
        return max((len(t.encode("utf-8")) for t in self.vocab()), default=1) or 1

    def vocab(self) -> dict[str, int]:
        """Every token's text -> id, added tokens included (a draft model must have the same)."""
        if self._tok is not None:
            return self._tok.get_vocab(with_added_tokens=True)
        return dict(self.hf.get_vocab())

    @property
    def has_tokenizer_json(self) -> bool:
        return self._tok is not None or getattr(self.hf, "backend_tokenizer", None) is not None

    def tokenizer_json(self) -> str | None:
        """The tokenizer as `tokenizers` JSON (what grammar libraries read), or None for a slow tokenizer."""
        if self._tok is not None:
            return self._tok.to_str()
        backend = getattr(self.hf, "backend_tokenizer", None)
        return backend.to_str() if backend is not None else None

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template shows the model its tools (rendering with one changes the prompt)."""
        if self._renders_tools is None:
            probe = [{"role": "user", "content": "hi"}]
            tool = {
                "type": "function",
                "function": {"name": "probe_tool_x", "description": "d", "parameters": {"type": "object"}},
            }
            try:
                self._renders_tools = self.has_chat_template and "probe_tool_x" in self.render_chat(probe, tools=[tool])
            except ValueError:
                self._renders_tools = False
        return self._renders_tools

    @property
    def tool_call_format(self) -> str | None:
        """How the model writes a call, as far as we parse it: "hermes" (<tool_call>{json}</tool_call>) or None."""
        return "hermes" if self.chat_template and "<tool_call>" in self.chat_template else None

    @functools.cached_property
    def reasoning_tags(self) -> tuple[str, str] | None:
        """(open, close) of the model's thinking when its template thinks, else None. The rule (as llama.cpp
        and vLLM detect Qwen3, DeepSeek-R1's distills and SmolLM3): `<think>` and `</think>` are each one
        token of the vocabulary, and the chat template writes `<think>` or reads `enable_thinking`."""
        template = self.chat_template or ""
        if "<think>" not in template and "enable_thinking" not in template:
            return None
        vocab = self.vocab()
        return (THINK_OPEN, THINK_CLOSE) if THINK_OPEN in vocab and THINK_CLOSE in vocab else None

    @property
    def can_stop_thinking(self) -> bool:
        """Whether the template has Qwen3's switch (`enable_thinking`) to render a prompt that does not think."""
        return "enable_thinking" in (self.chat_template or "")

    def thinks_from_prompt(self, messages: list[dict], tools: list[dict] | None = None, **template_args) -> bool:
        """Whether the rendered generation prompt already opens the thinking (DeepSeek-R1's templates end
        with `<think>`), so the output starts inside it."""
        tags = self.reasoning_tags
        if tags is None:
            return False
        text = self.render_chat(messages, tools=tools, **template_args)
        return text.rfind(tags[0]) > text.rfind(tags[1])

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **template_args,
    ) -> str:
        """The conversation as text, rendered with the model's chat template (and its tools, if given);
        `template_args` are the template's own switches (`enable_thinking=False`)."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        import jinja2

        try:
            if self._tok is None:
                return self.hf.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **template_args
                )
            return _compiled(self.chat_template).render(
                messages=[_with_reasoning_aliases(m) for m in messages],
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._special,
                **template_args,
            )
        except jinja2.TemplateError as exc:  # raise_exception() in the template, or a template bug
            raise ValueError(f"the model's chat template refused these messages: {exc}") from exc

    def chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **template_args,
    ) -> list[int]:
        """Token ids of the conversation rendered with the model's chat template (no special tokens added)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools, **template_args))


def _plain_tokenizer(model_dir: Path, config: dict):
    """A `tokenizers.Tokenizer` when the model's tokenizer is exactly its tokenizer.json, else None.

    Exactly means: a class with no behaviour of its own, and every named special token of the config already
    an added special token of the file (transformers would otherwise add it, changing encode and decode).
    """
    path = model_dir / "tokenizer.json"
    if config.get("tokenizer_class") not in _PLAIN_FAST or not path.is_file():
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    named = [_token_text(config[k]) for k in _NAMED_SPECIAL if config.get(k) is not None]
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    extra = list(extra.values()) if isinstance(extra, dict) else list(extra)
    if not all(t in special for t in named + [_token_text(t) for t in extra]):
        return None
    return tok


def _token_text(value) -> str:
    return value["content"] if isinstance(value, dict) else str(value)


def _chat_template(model_dir: Path, config: dict) -> str | None:
    """The default chat template: chat_template.jinja, else the config's (a string or named templates)."""
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template


def _with_reasoning_aliases(message: dict) -> dict:
    """Templates read a message's reasoning as reasoning_content (or thinking); fill both from whichever is set."""
    reasoning = next(
        (message[k] for k in ("reasoning_content", "thinking", "reasoning") if message.get(k) is not None), None
    )
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


@lru_cache(maxsize=8)
def _compiled(template: str):
    """The template compiled in a sandbox with what chat templates expect (transformers' environment)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters, which would change the prompt
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Namespace(jinja2.utils.Namespace):
        """namespace() that refuses underscore names, so a template cannot reach Python internals through it."""

        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")

    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %} marks the assistant's part for training masks; it renders as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class TemplateDict:
        """dict() and dict.fromkeys() for templates, without exposing the type itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=TemplateDict(),
        namespace=Namespace,
    )
    return env.from_string(template)

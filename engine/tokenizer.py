"""The text side of a model: encode, decode and render chat messages, without exposing transformers."""

from __future__ import annotations

import json
from pathlib import Path

# Tokenizer classes that are exactly the `tokenizers` backend with no behaviour of their own: they
# load through PreTrainedTokenizerFast directly. AutoTokenizer would first import transformers'
# model and config machinery (with torch): ~4 s and ~240 MB more at every start.
_PLAIN_FAST = ("TokenizersBackend", "PreTrainedTokenizerFast")


class TextTokenizer:
    """Wraps the model's Hugging Face tokenizer; the daemon and scripts use only these methods."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        config = model_dir / "tokenizer_config.json"
        cls = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
        if cls in _PLAIN_FAST and (model_dir / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast

            self.hf = PreTrainedTokenizerFast.from_pretrained(model_dir)
        else:
            from transformers import AutoTokenizer

            self.hf = AutoTokenizer.from_pretrained(model_dir)
        self.eos_token_id: int | None = self.hf.eos_token_id
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the conversation rendered with the model's chat template."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        ids = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        return list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)

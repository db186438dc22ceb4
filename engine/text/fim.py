"""Fill-in-the-middle: a coder model's own tokens for it, and the one assembly of its prompt.

A model trained to fill in the middle reads the code before the cursor and the code after it, each behind
a marker token of its vocabulary, then writes the middle after a third marker until it emits one of its
end tokens. The markers are the model's own (`FimTokens.of`, from its vocabulary, as llama.cpp finds them
when a GGUF's metadata does not name them): Qwen2.5-Coder's `<|fim_prefix|>`, StarCoder's `<fim_prefix>`,
CodeLlama's `▁<PRE>`, DeepSeek-Coder's `<｜fim▁begin｜>`, Codestral's `[PREFIX]`, each with its suffix and
middle markers; the repository-level ones (`<|repo_name|>`, `<|file_sep|>`) where the model has them.

The layout (`assemble`) is llama-server's `/infill`'s, so that an editor plugin gets the same prompt from
either: the other files' chunks first (repository-level: the repository marker and a name, then each chunk
behind the file marker and its file name; else each behind a plain-text separator), then the prefix marker,
the code before the cursor (its last tokens: at most 3/4 of the window), the suffix marker, the code after
it (its first tokens: the rest of the window's quarter), the middle marker. The chunks fill what the context
leaves past the window and twice the answer's length, the oldest cut first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# (prefix, suffix, middle, end-of-text, pad, repository, file separator) as each family's vocabulary spells them
_FAMILIES = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", None, "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", None, "<fim_pad>", "<repo_name>", "<file_sep>"),
    ("▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>", None, None, None),
    ("<PRE>", "<SUF>", "<MID>", "<EOT>", None, None, None),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", None, None, None, None),
    ("[PREFIX]", "[SUFFIX]", "[MIDDLE]", None, None, None, None),
)
# FimTokens' fields and the keys a GGUF names them by (tokenizer.ggml.fim_<key>_token_id); a GGUF's preparation
# keeps them in tokenizer_config.json as FIM_CONFIG_KEY: {field: id}
GGUF_KEYS = {"prefix": "pre", "suffix": "suf", "middle": "mid", "pad": "pad", "repo": "rep", "file_sep": "sep"}
FIM_CONFIG_KEY = "fim_token_ids"
WINDOW = 2048  # tokens of prefix and suffix together at most (llama-server's default batch), 3:1
REPO_NAME = "myproject\n"  # what the repository marker is followed by (llama-server's)
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"  # before each chunk, for a model without a file marker
CURRENT_FILE = "filename\n"  # the current file's name after its file marker (llama-server's)


@dataclass(frozen=True, slots=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    end: int | None = None  # end of the middle (CodeLlama's EOT)
    pad: int | None = None
    repo: int | None = None
    file_sep: int | None = None

    @classmethod
    def of(cls, vocab: dict[str, int], named: dict[str, int] | None = None) -> FimTokens | None:
        """The model's markers: those its GGUF's metadata named (`named`, FIM_CONFIG_KEY's), else found by their
        names in its vocabulary; None when it has no complete set."""
        size = max(vocab.values(), default=-1) + 1
        if named and all(
            isinstance(named.get(k), int) and 0 <= named[k] < size for k in ("prefix", "suffix", "middle")
        ):
            return cls(**{k: v for k, v in named.items() if k in GGUF_KEYS and isinstance(v, int) and 0 <= v < size})
        for names in _FAMILIES:
            ids = [vocab.get(n) if n is not None else None for n in names]
            if None not in ids[:3]:
                return cls(*ids)
        return None

    @property
    def stops(self) -> tuple[int, ...]:
        """Tokens that end a middle besides the model's end of text (llama.cpp counts these as end of
        generation): its end, pad and file markers."""
        return tuple(t for t in (self.end, self.pad, self.file_sep, self.repo) if t is not None)


@dataclass(slots=True)
class Infill:
    """What a client sends to be filled in: the code before and after the cursor, text to put right after the
    prefix (llama-server's `prompt`: the line typed so far), and other files' chunks (name, text), oldest first."""

    prefix: str
    suffix: str
    prompt: str = ""
    extra: Sequence[tuple[str, str]] = ()


def assemble(
    fim: FimTokens,
    encode: Callable[[str], list[int]],
    infill: Infill,
    context: int,
    max_tokens: int,
    bos: int | None = None,
    window: int = WINDOW,
    max_token_bytes: int | None = None,
) -> list[int]:
    """The prompt's ids (see the module's docstring); `bos` leads the prefix part when the model adds one.
    `max_token_bytes` (the most bytes one token stands for): each text is first cut to what can hold the tokens
    the layout keeps and 64 more (`cut_for`), so that a text far longer than the window is not encoded whole."""
    window = min(window, context)
    room = max(0, context - window - 2 * max_tokens)
    if max_token_bytes is not None:
        infill = cut_for(infill, window, room, max_token_bytes)
    extra: list[int] = []
    if fim.repo is not None and fim.file_sep is not None:
        extra += [fim.repo, *encode(REPO_NAME)]
    for name, text in infill.extra:
        if fim.file_sep is not None:
            extra += [fim.file_sep, *encode(f"{name}\n")]
        else:
            extra += encode(CHUNK_SEPARATOR)
        extra += encode(text)
    if fim.file_sep is not None:
        extra += [fim.file_sep, *encode(CURRENT_FILE)]
    prompt = encode(infill.prompt) if infill.prompt else []
    prefix = encode(infill.prefix)
    suffix = encode(infill.suffix)
    prefix = prefix[len(prefix) - min(len(prefix), 3 * (window // 4)) :]
    suffix = suffix[: min(len(suffix), max(0, window // 4 - (2 + len(prompt))))]
    extra = extra[len(extra) - min(room, len(extra)) :]  # the oldest chunks' tokens go first
    head = ([bos] if bos is not None else []) + [fim.prefix, *prefix, *prompt]
    return [*extra, *head, fim.suffix, *suffix, fim.middle]


SLACK = 64  # tokens kept past what the layout takes when a text is cut before encoding


def cut_for(infill: Infill, window: int, room: int, max_token_bytes: int) -> Infill:
    """`infill` with each text cut, before it is encoded, to the bytes that hold at least the tokens the layout
    keeps of it and SLACK more (a text of B bytes has at least B / max_token_bytes tokens): the prefix's last
    bytes, the suffix's first, the newest chunks' last within the room (older chunks left out whole). The
    tokens kept are the whole text's: a cut changes how the few tokens at it are split, and those SLACK go."""
    keep_prefix = (3 * (window // 4) + SLACK) * max_token_bytes
    keep_suffix = (window // 4 + SLACK) * max_token_bytes
    left = (room + SLACK) * max_token_bytes
    extra: list[tuple[str, str]] = []
    for name, text in reversed(infill.extra):
        if left <= 0:
            break
        text = tail_bytes(text, left)
        left -= len(text.encode("utf-8", "surrogatepass"))
        extra.append((name, text))
    extra.reverse()
    return Infill(tail_bytes(infill.prefix, keep_prefix), head_bytes(infill.suffix, keep_suffix), infill.prompt, extra)


def tail_bytes(text: str, size: int) -> str:
    """The text's last `size` bytes of UTF-8 or fewer (whole characters)."""
    if len(text) * 4 <= size:  # (cannot be longer: no need to encode it)
        return text
    data = text.encode("utf-8", "surrogatepass")
    return text if len(data) <= size else data[len(data) - size :].decode("utf-8", "ignore")


def head_bytes(text: str, size: int) -> str:
    """The text's first `size` bytes of UTF-8 or fewer (whole characters)."""
    if len(text) * 4 <= size:
        return text
    data = text.encode("utf-8", "surrogatepass")
    return text if len(data) <= size else data[:size].decode("utf-8", "ignore")

"""An encoder model's hyper-parameters (BERT, RoBERTa, XLM-RoBERTa, NomicBERT), read from its Hugging Face folder
(or the folder a GGUF file is prepared into: engine/encoders/gguf.py).

NomicBERT (nomic-embed-text) is BERT with rotary positions (rotate-half, over the whole head) in place of
learned ones, a SwiGLU MLP and no biases in its matrices; its folder spells the sizes GPT-2's way (`n_embd`).

An encoder attends both ways over its whole input, keeps no KV cache, and ends in a vector: an embedding pooled
as its sentence-transformers files say (`modules.json` -> the Pooling module's `config.json`; mean without one,
as sentence-transformers pools a bare transformer), or, for a `*ForSequenceClassification` checkpoint (a
cross-encoder reranker), the score of its classification head over the first token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from minibatch.engine.models.config import UnsupportedModelError

ENCODER_MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "nomic_bert")
# what a task of the engine is called where it is shown (/health, /api/show's capabilities derive from it)
TASKS = ("generate", "embed", "rerank")
# a head per family: BERT's pooler (tanh of a dense layer over the first token) then a linear classifier;
# RoBERTa's classifier: a dense layer, tanh, an output projection
HEADS = {"bert": "bert", "roberta": "roberta", "xlm-roberta": "roberta", "nomic_bert": "bert"}
# NomicBERT's config keys -> BERT's
_NOMIC_KEYS = {
    "n_embd": "hidden_size",
    "n_inner": "intermediate_size",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "layer_norm_epsilon": "layer_norm_eps",
    "n_positions": "max_position_embeddings",
    "rotary_emb_base": "rope_theta",
}
_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh")


def is_encoder_dir(model_dir: str | Path) -> bool:
    """Whether `model_dir`'s config.json describes an encoder (a decoder's does not name one of ours)."""
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text()).get("model_type") in ENCODER_MODEL_TYPES
    except (OSError, ValueError):
        return False


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    max_position: int  # the positions the model has embeddings for (less RoBERTa's offset)
    type_vocab_size: int  # BERT: 2 (a pair's second text is type 1), RoBERTa: 1
    position_offset: int  # RoBERTa counts positions from its padding id + 1; BERT from 0
    gelu_tanh: bool  # the tanh approximation of GELU (gelu_new) instead of erf's
    pooling: str  # "mean" or "cls" (embedding models), "rank" (a classification head scores the first token)
    num_labels: int  # the classification head's outputs (rank: 1, a relevance logit)
    sep_token_id: int | None  # where a pair's second text starts (its token type turns 1 after the first)
    rope_theta: float | None = None  # rotary positions (NomicBERT) instead of learned ones
    gated_mlp: bool = False  # SwiGLU: down(silu(gate(x)) * up(x)) (NomicBERT) instead of down(gelu(up(x)))
    bias: bool = True  # the attention's and the MLP's matrices have biases (NomicBERT's do not)

    @property
    def head(self) -> str:
        return HEADS[self.model_type]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def tasks(self) -> tuple[str, ...]:
        return ("rerank",) if self.pooling == "rank" else ("embed",)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> EncoderConfig:
        model_dir = Path(model_dir)
        cfg = json.loads((model_dir / "config.json").read_text())
        model_type = cfg.get("model_type")
        if model_type == "nomic_bert":
            cfg = _nomic(cfg)
        if model_type not in ENCODER_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not an encoder we run ({', '.join(ENCODER_MODEL_TYPES)})"
            )
        act = cfg.get("hidden_act", "gelu")
        nomic = model_type == "nomic_bert"
        if act not in _ACTIVATIONS and not nomic:
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported ({', '.join(_ACTIVATIONS)})")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModelError(
                f"position_embedding_type {cfg['position_embedding_type']!r} is not supported (absolute)"
            )
        classifier = any(a.endswith("ForSequenceClassification") for a in cfg.get("architectures") or ())
        if cfg.get("pooling", "mean") not in ("mean", "cls", "rank"):  # a GGUF's, as engine/encoders/gguf.py writes it
            raise UnsupportedModelError(f"pooling {cfg['pooling']!r} is not supported (mean, cls, rank)")
        if classifier and _num_labels(cfg) != 1:
            raise UnsupportedModelError(
                f"num_labels {_num_labels(cfg)}: a reranker scores a pair with one output; this classifier has "
                f"{_num_labels(cfg)} labels"
            )
        roberta = model_type in ("roberta", "xlm-roberta")
        offset = cfg.get("pad_token_id", 1) + 1 if roberta else 0
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        if hidden % heads:
            raise UnsupportedModelError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
            max_position=cfg["max_position_embeddings"] - offset,
            type_vocab_size=cfg.get("type_vocab_size", 2),
            position_offset=offset,
            gelu_tanh=act in ("gelu_new", "gelu_pytorch_tanh"),
            pooling="rank" if classifier else cfg.get("pooling") or _st_pooling(model_dir),
            num_labels=_num_labels(cfg) if classifier else 0,
            sep_token_id=_sep_token_id(model_dir),
            rope_theta=float(cfg.get("rope_theta", 10000.0)) if nomic else None,
            gated_mlp=nomic,
            bias=not nomic,
        )


def _nomic(cfg: dict) -> dict:
    """NomicBERT's config in BERT's keys; what our forward does not run (a bias, partial or interleaved rotary,
    pre-norm layers, another activation, its mixture-of-experts variant) refused by name."""
    out = {_NOMIC_KEYS.get(k, k): v for k, v in cfg.items()}
    expect = {
        "activation_function": "swiglu",
        "qkv_proj_bias": False,
        "mlp_fc1_bias": False,
        "mlp_fc2_bias": False,
        "prenorm": False,
        "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False,
        "causal": False,
    }
    for key, want in expect.items():
        if key in cfg and cfg[key] != want:
            raise UnsupportedModelError(f"nomic_bert with {key} {cfg[key]!r} is not supported ({want!r})")
    if cfg.get("moe_every_n_layers"):
        raise UnsupportedModelError("nomic_bert's mixture-of-experts layers (moe_every_n_layers) are not supported")
    out.setdefault("hidden_act", "swiglu")
    return out


def _num_labels(cfg: dict) -> int:
    labels = cfg.get("id2label")
    return len(labels) if isinstance(labels, dict) and labels else int(cfg.get("num_labels", 2))


def _st_pooling(model_dir: Path) -> str:
    """The pooling of a sentence-transformers folder (its Pooling module's config), else mean."""
    try:
        modules = json.loads((model_dir / "modules.json").read_text())
    except (OSError, ValueError):
        return "mean"
    for module in modules:
        if str(module.get("type", "")).endswith("Pooling"):
            try:
                pool = json.loads((model_dir / module.get("path", "") / "config.json").read_text())
            except (OSError, ValueError):
                return "mean"
            if pool.get("pooling_mode_cls_token"):
                return "cls"
            if pool.get("pooling_mode_mean_tokens", True):
                return "mean"
            modes = ", ".join(k for k, v in pool.items() if k.startswith("pooling_mode") and v)
            raise UnsupportedModelError(f"pooling {modes or 'none'} is not supported (mean, cls)")
    return "mean"


def _sep_token_id(model_dir: Path) -> int | None:
    """The separator's id, from the tokenizer's files (BERT's [SEP], RoBERTa's </s>)."""
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None
    sep = config.get("sep_token")
    if isinstance(sep, dict):
        sep = sep.get("content")
    for added in tokenizer.get("added_tokens", []):
        if added.get("content") == sep:
            return int(added["id"])
    return None

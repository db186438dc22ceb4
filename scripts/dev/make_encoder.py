"""Random-weight encoder models in the shapes of the ones retrieval setups use, saved as a Hugging Face folder
and as the GGUF llama.cpp's converter would write from it, with a tokenizer made here (nothing downloaded):

  .venv/bin/python scripts/dev/make_encoder.py --shape bert-base --out models/bert-base    # + bert-base.gguf
  .venv/bin/python scripts/dev/make_encoder.py --shape bge-reranker-base --out models/reranker --dtype F32

Shapes: `minilm` (all-MiniLM-L6-v2: 384 wide, 6 layers), `bert-base` (bge-base, e5-base: 768, 12 layers),
`nomic` (nomic-embed-text: BERT-base's size with rotary positions and SwiGLU), `bge-reranker-base` (an
XLM-RoBERTa cross-encoder of BERT-base's size). The vocabulary is small (WordPiece for BERT and NomicBERT, a
Unigram one for XLM-RoBERTa: common English words and characters), so the embedding tables are narrow; every
matrix a token goes through has the named model's shape. The tests make their tiny models with the same
functions (`save_bert`, `save_xlmr_reranker`, `save_nomic` and the GGUF writers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

WORDS = (
    "the a of to and in is it that for on with as was at by be this an are or from not but have they which one "
    "you were all we when there can her has more if will what about up out who get so them some would make like "
    "him into time than its only over also cat dog mat sat paged cache block batch step query document"
).split()
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789.,!?'")
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)  # the tests'
SHAPES = {
    "minilm": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
    "bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "nomic": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "bge-reranker-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
}
CONTEXT = 514  # position rows (less XLM-R's offset of 2: 512 tokens), as the named models have


def _bert_tokenizer(path: Path):
    import transformers
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(specials + WORDS + CHARS + ["##" + c for c in CHARS]))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tok.decoder = decoders.WordPiece()
    named = dict(unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]")
    transformers.BertTokenizerFast(tokenizer_object=tok, **named).save_pretrained(path)
    return len(vocab)


def _spread_head(model, dense, out) -> None:
    """A random head's logits are ~1e-3 apart; wider weights (and initializer_range 0.2 below it) make the
    order of documents mean something."""
    import torch

    with torch.no_grad():
        dense.weight.normal_(0, 0.3)
        out.weight.normal_(0, 1.0)
        out.bias.normal_(0, 0.5)


def save_bert(
    path: Path, seed: int = 0, classifier: bool = False, pooling: str | None = None, shape: dict = SHAPE, context=128
) -> Path:
    """A BERT embedding model (pooling as sentence-transformers files say: `cls` or `mean`; None: no files,
    mean by default) or, with `classifier`, a one-label cross-encoder (BertForSequenceClassification)."""
    import torch
    import transformers

    vocab = _bert_tokenizer(path)
    torch.manual_seed(seed)
    spread = {"initializer_range": 0.2} if classifier else {}
    cfg = transformers.BertConfig(vocab_size=vocab, max_position_embeddings=context, **shape, num_labels=1, **spread)
    if classifier:
        model = transformers.BertForSequenceClassification(cfg)
        _spread_head(model, model.bert.pooler.dense, model.classifier)
    else:
        model = transformers.BertModel(cfg, add_pooling_layer=False)
    model.save_pretrained(path)
    if pooling is not None:
        (path / "1_Pooling").mkdir(exist_ok=True)
        modes = {"pooling_mode_cls_token": pooling == "cls", "pooling_mode_mean_tokens": pooling == "mean"}
        size = {"word_embedding_dimension": shape["hidden_size"]}
        (path / "1_Pooling" / "config.json").write_text(json.dumps({**size, **modes}))
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ]
        (path / "modules.json").write_text(json.dumps(modules))
    return path


def save_xlmr_reranker(path: Path, seed: int = 1, shape: dict = SHAPE, context: int = 130) -> Path:
    """An XLM-RoBERTa cross-encoder (XLMRobertaForSequenceClassification, one label) with a Unigram tokenizer."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    pieces = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + w, -3.0 - i * 0.01) for i, w in enumerate(WORDS)]
    pieces += [(c, -8.0) for c in CHARS] + [("\u2581", -5.0), ("<mask>", 0.0)]
    tok = Tokenizer(models.Unigram(pieces, unk_id=3, byte_fallback=False))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    named = dict(bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>", unk_token="<unk>")
    transformers.XLMRobertaTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", mask_token="<mask>", **named
    ).save_pretrained(path)
    torch.manual_seed(seed)
    cfg = transformers.XLMRobertaConfig(
        vocab_size=len(pieces),
        max_position_embeddings=context,
        type_vocab_size=1,
        pad_token_id=1,
        num_labels=1,
        initializer_range=0.2,
        **shape,
    )
    model = transformers.XLMRobertaForSequenceClassification(cfg)
    _spread_head(model, model.classifier.dense, model.classifier.out_proj)
    model.save_pretrained(path)
    return path


# Hugging Face name pieces -> GGUF's, as llama.cpp's converter writes an encoder (its `bert` architecture)
GGUF_TOP = {
    "embeddings.word_embeddings": "token_embd",
    "embeddings.position_embeddings": "position_embd",
    "embeddings.token_type_embeddings": "token_types",
    "embeddings.LayerNorm": "token_embd_norm",
    "classifier.dense": "cls",
    "classifier.out_proj": "cls.output",
}
GGUF_LAYER = {
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}


def _stored(name: str, tensor, dtype: str):
    """A tensor as the converter stores it: matrices in `dtype`, but vectors, position and token-type tables in
    F32 (llama.cpp adds those to F32 activations, which it cannot do from F16)."""
    array = tensor.float().numpy()
    wide = array.ndim == 2 and not name.startswith(("position_embd", "token_types"))
    return array.astype("float16") if dtype == "F16" and wide else array


def write_encoder_gguf(hf_dir: Path, out: Path, pooling: int, dtype: str = "F32") -> Path:
    """An encoder GGUF as llama.cpp's converter lays one out: `bert` architecture, BERT's WordPiece pieces as
    phantom-space pieces ("▁" word starts, bare continuations) or XLM-R's Unigram pieces and scores (its
    position rows past the padding offset only), every tensor F32 or F16, pooling_type 1 mean / 2 cls /
    4 rank (XLM-R's classifier as cls and cls.output)."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    xlmr = cfg["model_type"] == "xlm-roberta"
    offset = cfg["pad_token_id"] + 1 if xlmr else 0
    w = gguf.GGUFWriter(str(out), "bert")
    w.add_context_length(cfg["max_position_embeddings"] - offset)
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_layer_norm_eps(cfg["layer_norm_eps"])
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType(pooling))
    w.add_token_type_count(cfg.get("type_vocab_size", 1))
    control = {t["content"] for t in tok["added_tokens"] if t.get("special")}
    if xlmr:
        pieces = tok["model"]["vocab"]
        tokens, scores = [p for p, _ in pieces], [float(s) for _, s in pieces]
        w.add_tokenizer_model("t5")
        w.add_tokenizer_pre("default")
        w.add_token_scores(scores)
        w.add_add_space_prefix(True)  # (the converter's, from the tokenizer's Metaspace and its cleanup)
        w.add_remove_extra_whitespaces(True)
        # what gguf's SpecialVocab reads off the pair template: <s> q </s> </s> d </s> (llama-server's rerank)
        w.add_add_bos_token(True)
        w.add_add_eos_token(True)
        w.add_add_sep_token(True)
        ids = {"bos": 0, "pad": 1, "eos": 2, "unk": 3, "sep": 2, "cls": 0, "mask": len(tokens) - 1}
    else:
        vocab = tok["model"]["vocab"]
        ordered = sorted(vocab, key=vocab.get)
        tokens = [t if t in control else t[2:] if t.startswith("##") else "\u2581" + t for t in ordered]
        w.add_tokenizer_model("bert")
        ids = {"unk": vocab["[UNK]"], "sep": vocab["[SEP]"], "cls": vocab["[CLS]"], "pad": vocab["[PAD]"]}
        ids["mask"], ids["bos"], ids["eos"] = vocab["[MASK]"], vocab["[CLS]"], vocab["[SEP]"]
    w.add_token_list(tokens)
    w.add_token_types([3 if (t in control) else 1 for t in tokens])
    keys = {"bos": "bos", "eos": "eos", "unk": "unknown", "sep": "seperator", "pad": "padding", "cls": "cls"}
    for name, i in ids.items():  # (llama.cpp spells the separator's key "seperator")
        w.add_uint32(f"tokenizer.ggml.{keys.get(name, name)}_token_id", i)
    for key, tensor in load_file(hf_dir / "model.safetensors").items():
        key = key.removeprefix("bert.").removeprefix("roberta.")
        module, _, leaf = key.rpartition(".")
        if module.startswith("encoder.layer."):
            _, _, n, rest = module.split(".", 3)
            name = f"blk.{n}.{GGUF_LAYER[rest]}.{leaf}"
        elif module in GGUF_TOP:
            name = f"{GGUF_TOP[module]}.{leaf}"
        else:
            continue  # position_ids buffers, BERT's pooler (the converter drops it)
        if module == "embeddings.position_embeddings":
            tensor = tensor[offset:]
        w.add_tensor(name, _stored(name, tensor, dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


NOMIC_LAYER = {  # NomicBERT's names -> GGUF's (the converter's tensor map)
    "attn.Wqkv": "attn_qkv",
    "attn.out_proj": "attn_output",
    "norm1": "attn_output_norm",
    "mlp.fc11": "ffn_up",
    "mlp.fc12": "ffn_gate",
    "mlp.fc2": "ffn_down",
    "norm2": "layer_output_norm",
}


def save_nomic(
    path: Path, seed: int = 4, theta: float = 1000.0, shape: dict = SHAPE, context: int = 128, std: float = 0.02
) -> dict:
    """A NomicBERT folder as nomic-embed-text's is laid out (its config's GPT-2-style keys, Wqkv stacked, fc11 the
    up projection and fc12 the gate, no biases in the matrices) with a BERT tokenizer; returns its tensors."""
    import torch
    from safetensors.torch import save_file

    vocab = _bert_tokenizer(path)
    h, ff, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, std=std):  # 0.02: a trained model's scale (BERT's initializer_range); wider is sharper
        return torch.randn(*shape, generator=g) * std

    t = {
        "embeddings.word_embeddings.weight": rand(vocab, h),
        "embeddings.token_type_embeddings.weight": rand(2, h),
        "emb_ln.weight": 1 + rand(h, std=0.1),
        "emb_ln.bias": rand(h, std=0.1),
    }
    for i in range(layers):
        p = f"encoder.layers.{i}."
        t |= {p + "attn.Wqkv.weight": rand(3 * h, h), p + "attn.out_proj.weight": rand(h, h)}
        t |= {p + "mlp.fc11.weight": rand(ff, h), p + "mlp.fc12.weight": rand(ff, h), p + "mlp.fc2.weight": rand(h, ff)}
        for norm in ("norm1", "norm2"):
            t |= {f"{p}{norm}.weight": 1 + rand(h, std=0.1), f"{p}{norm}.bias": rand(h, std=0.1)}
    save_file(t, path / "model.safetensors")
    cfg = {
        "model_type": "nomic_bert",
        "architectures": ["NomicBertModel"],
        "vocab_size": vocab,
        "n_embd": h,
        "n_inner": ff,
        "n_layer": layers,
        "n_head": shape["num_attention_heads"],
        "n_positions": context,
        "layer_norm_epsilon": 1e-12,
        "rotary_emb_base": theta,
        "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False,
        "activation_function": "swiglu",
        "qkv_proj_bias": False,
        "mlp_fc1_bias": False,
        "mlp_fc2_bias": False,
        "prenorm": False,
        "causal": False,
        "type_vocab_size": 2,
    }
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return t


def nomic_reference(t: dict, ids: list[int], theta: float = 1000.0, heads: int = 4) -> torch.Tensor:
    """NomicBERT's last hidden states for one input, in float64, written from its definition (the reference
    the tests hold our forward to)."""
    import torch
    import torch.nn.functional as F

    d64 = {k: v.double() for k, v in t.items()}
    n = len(ids)
    x = d64["embeddings.word_embeddings.weight"][ids] + d64["embeddings.token_type_embeddings.weight"][0]
    x = F.layer_norm(x, x.shape[-1:], d64["emb_ln.weight"], d64["emb_ln.bias"], 1e-12)
    h = x.shape[-1]
    d = h // heads
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]

    def rotate(v):
        a, b = v.chunk(2, dim=-1)
        return v * cos + torch.cat([-b, a], -1) * sin

    layers = len([k for k in t if k.endswith("attn.Wqkv.weight")])
    for i in range(layers):
        p = f"encoder.layers.{i}."
        q, k, v = (x @ d64[p + "attn.Wqkv.weight"].T).view(n, 3, heads, d).unbind(1)
        q, k = rotate(q), rotate(k)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
        att = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, h)
        x = F.layer_norm(
            x + att @ d64[p + "attn.out_proj.weight"].T, (h,), d64[p + "norm1.weight"], d64[p + "norm1.bias"], 1e-12
        )
        mlp = (F.silu(x @ d64[p + "mlp.fc12.weight"].T) * (x @ d64[p + "mlp.fc11.weight"].T)) @ d64[
            p + "mlp.fc2.weight"
        ].T
        x = F.layer_norm(x + mlp, (h,), d64[p + "norm2.weight"], d64[p + "norm2.bias"], 1e-12)
    return x


def write_nomic_gguf(folder: Path, tensors: dict, out: Path, theta: float = 1000.0, dtype: str = "F32") -> Path:
    """The NomicBERT folder as llama.cpp's converter writes it (`nomic-bert`, F32 or F16 matrices, mean pooling)."""
    import gguf

    cfg = json.loads((folder / "config.json").read_text())
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    control = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}
    ordered = sorted(vocab, key=vocab.get)
    tokens = [t if t in control else t[2:] if t.startswith("##") else "\u2581" + t for t in ordered]
    w = gguf.GGUFWriter(str(out), "nomic-bert")
    w.add_context_length(cfg["n_positions"])
    w.add_embedding_length(cfg["n_embd"])
    w.add_feed_forward_length(cfg["n_inner"])
    w.add_block_count(cfg["n_layer"])
    w.add_head_count(cfg["n_head"])
    w.add_layer_norm_eps(cfg["layer_norm_epsilon"])
    w.add_causal_attention(False)
    w.add_rope_freq_base(theta)
    w.add_pooling_type(gguf.PoolingType.MEAN)
    w.add_token_type_count(2)
    w.add_tokenizer_model("bert")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in control else 1 for t in tokens])
    for key, name in (("unknown", "[UNK]"), ("seperator", "[SEP]"), ("cls", "[CLS]"), ("padding", "[PAD]")):
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", vocab[name])
    w.add_uint32("tokenizer.ggml.bos_token_id", vocab["[CLS]"])
    w.add_uint32("tokenizer.ggml.eos_token_id", vocab["[SEP]"])
    top = {"embeddings.word_embeddings": "token_embd", "embeddings.token_type_embeddings": "token_types"}
    top["emb_ln"] = "token_embd_norm"
    for key, tensor in tensors.items():
        module, _, leaf = key.rpartition(".")
        if module.startswith("encoder.layers."):
            _, _, n, rest = module.split(".", 3)
            name = f"blk.{n}.{NOMIC_LAYER[rest]}.{leaf}"
        else:
            name = f"{top[module]}.{leaf}"
        w.add_tensor(name, _stored(name, tensor, dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", type=Path, required=True, help="the folder; the GGUF is written beside it (.gguf)")
    ap.add_argument("--dtype", choices=("F32", "F16"), default="F16", help="the GGUF's matrices")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the named model's (a quick one)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    gguf = args.out.with_suffix(".gguf")
    shape = SHAPES[args.shape] | ({"num_hidden_layers": args.layers} if args.layers else {})
    if args.shape == "bge-reranker-base":
        save_xlmr_reranker(args.out, args.seed, shape, CONTEXT)
        write_encoder_gguf(args.out, gguf, 4, args.dtype)
    elif args.shape == "nomic":
        tensors = save_nomic(args.out, args.seed, 1000.0, shape, CONTEXT - 2)
        write_nomic_gguf(args.out, tensors, gguf, 1000.0, args.dtype)
    else:
        save_bert(args.out, args.seed, pooling="mean", shape=shape, context=CONTEXT - 2)
        write_encoder_gguf(args.out, gguf, 1, args.dtype)
    print(f"wrote {args.out}/ and {gguf}")


if __name__ == "__main__":
    main()

"""Tiny random encoder models saved as Hugging Face folders, with tokenizers made here (no download): BERT with a
WordPiece vocabulary (an embedding model, or a cross-encoder with its pooler and classifier), XLM-RoBERTa with a
SentencePiece-style Unigram vocabulary (a bge-reranker-shaped cross-encoder)."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = (
    "the a of to and in is it that for on with as was at by be this an are or from not but have they which one "
    "you were all we when there can her has more if will what about up out who get so them some would make like "
    "him into time than its only over also cat dog mat sat paged cache block batch step query document"
).split()
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789.,!?'")
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


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


def save_bert(path: Path, seed: int = 0, classifier: bool = False, pooling: str | None = None) -> Path:
    """A BERT embedding model (pooling as sentence-transformers files say: `cls` or `mean`; None: no files,
    mean by default) or, with `classifier`, a one-label cross-encoder (BertForSequenceClassification)."""
    import torch
    import transformers

    vocab = _bert_tokenizer(path)
    torch.manual_seed(seed)
    spread = {"initializer_range": 0.2} if classifier else {}
    cfg = transformers.BertConfig(vocab_size=vocab, max_position_embeddings=128, **SHAPE, num_labels=1, **spread)
    if classifier:
        model = transformers.BertForSequenceClassification(cfg)
        _spread_head(model, model.bert.pooler.dense, model.classifier)
    else:
        model = transformers.BertModel(cfg, add_pooling_layer=False)
    model.save_pretrained(path)
    if pooling is not None:
        (path / "1_Pooling").mkdir(exist_ok=True)
        modes = {"pooling_mode_cls_token": pooling == "cls", "pooling_mode_mean_tokens": pooling == "mean"}
        (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ]
        (path / "modules.json").write_text(json.dumps(modules))
    return path


def save_xlmr_reranker(path: Path, seed: int = 1) -> Path:
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
        max_position_embeddings=130,
        type_vocab_size=1,
        pad_token_id=1,
        num_labels=1,
        initializer_range=0.2,
        **SHAPE,
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
        w.add_token_scores(scores)
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
        array = tensor.float().numpy()
        w.add_tensor(name, array.astype("float16") if dtype == "F16" and array.ndim == 2 else array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out

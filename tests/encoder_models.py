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

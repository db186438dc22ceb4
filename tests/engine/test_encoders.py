"""Encoder models in the engine (engine/encoders/): BERT and XLM-RoBERTa from their Hugging Face folders, each
input computed whole in one step and batched with others of other lengths, against transformers on the same
weights: the pooled embeddings (mean, cls) and a cross-encoder's scores (BERT's pair token types, RoBERTa's
offset positions); the same bits alone and in a batch; nothing cached, every block back."""

from __future__ import annotations

import json

import pytest
import torch
from make_encoder import save_bert, save_xlmr_reranker, write_encoder_gguf

from minibatch.engine.core.sampling_params import SamplingParams
from minibatch.engine.encoders.config import EncoderConfig, is_encoder_dir
from minibatch.engine.factory import EngineConfig, build_engine
from minibatch.engine.models.config import UnsupportedModelError

TEXTS = [
    "the cat sat on the mat.",
    "a paged cache keeps the batch in blocks, one step at a time, as we would like",
    "dog",
    "what is it about the time, when we get out? who can make it over",
]
QUERY = "what is a paged cache"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    return {
        "bert-mean": save_bert(root / "bert-mean"),
        "bert-cls": save_bert(root / "bert-cls", seed=2, pooling="cls"),
        "bert-rerank": save_bert(root / "bert-rerank", seed=3, classifier=True),
        "xlmr-rerank": save_xlmr_reranker(root / "xlmr-rerank"),
    }


def engine(path, mode="continuous", seqs=8):
    return build_engine(EngineConfig(model=str(path), mode=mode, max_num_seqs=seqs, max_num_batched_tokens=16))


def run(e, inputs: list[list[int]], pooling: str) -> list[list[float]]:
    for i, ids in enumerate(inputs):
        e.add_request(f"r{i}", ids, SamplingParams(temperature=0.0, max_tokens=1), pooling=pooling)
    done = {}
    while e.has_work():
        outputs, _ = e.step()
        e.scheduler.blocks.check_integrity()
        done.update({o.request_id: o for o in outputs if o.finished})
    assert e.scheduler.blocks.num_used_blocks == 0
    return [done[f"r{i}"].embedding for i in range(len(inputs))]


def reference(path, inputs: list[list[int]], pooling: str) -> list[torch.Tensor]:
    import transformers

    cls = transformers.AutoModelForSequenceClassification if pooling == "rank" else transformers.AutoModel
    hf = cls.from_pretrained(path).eval()
    out = []
    for ids in inputs:
        x = torch.tensor([ids])
        kw = {}
        if "bert" in path.name:  # a pair's second text is type 1 (the tokenizer's token_type_ids)
            sep = ids.index(3)
            kw["token_type_ids"] = torch.tensor([[0] * (sep + 1) + [1] * (len(ids) - sep - 1)])
        with torch.no_grad():
            if pooling == "rank":
                out.append(hf(x, **kw).logits[0])
            else:
                hidden = hf(x, **kw).last_hidden_state[0]
                out.append(hidden.mean(0) if pooling == "mean" else hidden[0])
    return out


@pytest.mark.parametrize("name,pooling", [("bert-mean", "mean"), ("bert-cls", "cls")])
def test_embeddings_equal_transformers_in_one_batch(models, name, pooling):
    e = engine(models[name])
    assert e.info.tasks == ("embed",) and e.info.pooling == pooling and e.info.kv_cache_type == "none"
    inputs = [e.tokenizer.encode_prompt(t) for t in TEXTS]
    assert inputs[0][0] == 2 and inputs[0][-1] == 3  # [CLS] ... [SEP]
    got = run(e, inputs, pooling)
    for vector, want in zip(got, reference(models[name], inputs, pooling)):
        vector = torch.tensor(vector)
        assert vector.shape == (64,)
        assert torch.nn.functional.cosine_similarity(vector, want, dim=0) > 0.99999
        assert (vector - want).abs().max() < 1e-5


@pytest.mark.parametrize("name", ["bert-rerank", "xlmr-rerank"])
def test_cross_encoder_scores_equal_transformers_and_order_the_documents(models, name):
    e = engine(models[name])
    assert e.info.tasks == ("rerank",) and e.info.pooling == "rank" and e.info.embedding_size == 1
    pairs = [e.tokenizer.encode_pair(QUERY, t) for t in TEXTS]
    got = [s[0] for s in run(e, pairs, "rank")]
    want = [float(w[0]) for w in reference(models[name], pairs, "rank")]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    assert sorted(range(4), key=lambda i: -got[i]) == sorted(range(4), key=lambda i: -want[i])
    assert max(want) - min(want) > 0.1  # the scores differ enough for the order to be a check


@pytest.mark.parametrize("name,pooling,dtype", [("bert-cls", 2, "F16"), ("xlmr-rerank", 4, "F32")])
def test_gguf_files_as_llama_cpp_writes_them_tokenize_and_compute_as_their_folders(
    models, tmp_path, name, pooling, dtype
):
    """The converter's layout (phantom-space WordPiece, or Unigram pieces with XLM-R's position rows cut at the
    offset): the same token ids as the folder's tokenizer, alone and in pairs, and the same vectors and scores
    as transformers on the folder (F16 matrices: their rounding is the allowance)."""
    path = write_encoder_gguf(models[name], tmp_path / f"{name}.gguf", pooling, dtype)
    e = engine(path)
    folder = engine(models[name]).tokenizer
    assert e.info.weights == f"{dtype} dequantised to float32"
    mode = "rank" if pooling == 4 else "cls"
    if mode == "rank":
        inputs = [e.tokenizer.encode_pair(QUERY, t) for t in TEXTS]
        assert inputs == [folder.encode_pair(QUERY, t) for t in TEXTS]
        got = [s[0] for s in run(e, inputs, mode)]
        want = [float(w[0]) for w in reference(models[name], inputs, mode)]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    else:
        inputs = [e.tokenizer.encode_prompt(t) for t in TEXTS]
        assert inputs == [folder.encode_prompt(t) for t in TEXTS]
        for vector, want in zip(run(e, inputs, mode), reference(models[name], inputs, mode)):
            assert torch.nn.functional.cosine_similarity(torch.tensor(vector), want, dim=0) > 0.9999


def test_an_input_gets_the_same_bits_alone_and_in_a_batch_in_either_mode(models):
    inputs = [engine(models["bert-mean"]).tokenizer.encode_prompt(t) for t in TEXTS]
    alone = run(engine(models["bert-mean"], seqs=1), inputs[1:2], "mean")[0]
    for mode in ("continuous", "static"):
        assert run(engine(models["bert-mean"], mode=mode), inputs, "mean")[1] == alone


def test_encoder_configs_are_read_and_refused_by_name(models, tmp_path):
    assert is_encoder_dir(models["bert-mean"]) and not is_encoder_dir(tmp_path)
    xlmr = EncoderConfig.from_dir(models["xlmr-rerank"])
    assert (xlmr.position_offset, xlmr.max_position, xlmr.pooling, xlmr.sep_token_id) == (2, 128, "rank", 2)
    bert = EncoderConfig.from_dir(models["bert-cls"])
    assert (bert.position_offset, bert.max_position, bert.pooling, bert.sep_token_id) == (0, 128, "cls", 3)
    for change, words in (
        ({"num_labels": 3, "id2label": {"0": "a", "1": "b", "2": "c"}}, "num_labels 3"),
        ({"hidden_act": "relu"}, "hidden_act 'relu'"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type 'relative_key'"),
    ):
        folder = tmp_path / str(len(words))
        folder.mkdir()
        cfg = json.loads((models["bert-rerank"] / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(UnsupportedModelError, match=words):
            EncoderConfig.from_dir(folder)


def test_nomic_bert_folder_and_gguf_equal_its_reference(tmp_path):
    """NomicBERT (rotary positions, SwiGLU, no biases) from its folder and from the GGUF llama.cpp's converter
    would write: mean-pooled vectors equal to the float64 reference within float32's rounding, the same
    tokens from either, each input alone as in the batch."""
    from make_encoder import nomic_reference, save_nomic, write_nomic_gguf

    folder = tmp_path / "nomic"
    folder.mkdir()
    tensors = save_nomic(folder, std=0.2)  # wide weights: a wrong rotation or MLP is far past the bound
    gguf = write_nomic_gguf(folder, tensors, tmp_path / "nomic.gguf")
    for path in (folder, gguf):
        e = engine(path)
        assert e.info.family == "nomic_bert" and e.info.pooling == "mean"
        inputs = [e.tokenizer.encode_prompt(t) for t in TEXTS]
        got = run(e, inputs, "mean")
        for ids, vector in zip(inputs, got):
            want = nomic_reference(tensors, ids).mean(0)
            assert (torch.tensor(vector, dtype=torch.float64) - want).abs().max() < 1e-5
        assert run(engine(path, seqs=1), inputs[3:], "mean")[0] == got[3]


def test_a_decoder_reranker_gguf_scores_its_last_token_as_transformers_does(tmp_path):
    """Qwen3-Reranker as llama.cpp converts it (pooling_type rank, the lm_head's "yes" and "no" rows as
    cls.output, its judge prompt as the `rerank` chat template): each pair is that prompt, scored at its last
    token as softmax(yes, no)'s first share, which equals transformers' next-token distribution there; its
    engine reranks and nothing else."""
    import transformers
    from gguf import GGUFWriter, PoolingType
    from safetensors.torch import load_file

    from minibatch.engine.store.cache import resolve_model
    from tests.conftest import TINY_COMMON
    from tests.engine.gguf_models import gguf_name, write_converter_metadata

    torch.manual_seed(11)
    hf = tmp_path / "qwen3"
    cfg = transformers.Qwen3Config(**TINY_COMMON, head_dim=16, tie_word_embeddings=True, bos_token_id=1)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(hf)
    yes, no = ord("y"), ord("n")  # (the 256-byte vocabulary's; a real file's are the words' tokens)
    template = "<|bos|>Judge.\nQuery: {query}\nDocument: {document}\nAnswer:"
    path = tmp_path / "reranker.gguf"
    w = GGUFWriter(str(path), "qwen3")
    write_converter_metadata(w, {**cfg.to_dict(), "rope_theta": 10000.0}, "qwen3")
    w.add_pooling_type(PoolingType.RANK)
    w.add_string("tokenizer.chat_template.rerank", template)
    for name, tensor in sorted(load_file(hf / "model.safetensors").items()):
        w.add_tensor(gguf_name(name, "qwen3"), tensor.float().numpy())
    embed = model.model.embed_tokens.weight.detach()
    w.add_tensor("cls.output.weight", torch.stack([embed[yes], embed[no]]).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    e = engine(resolve_model(str(path), cache_dir=tmp_path / "cache"))
    assert e.info.tasks == ("rerank",) and e.info.pooling == "rank" and e.info.embedding_size == 1
    docs = ["a cat", "paged blocks of keys and values", "x"]
    pairs = [e.tokenizer.encode_pair("what is a cache", d) for d in docs]
    assert pairs[0] == e.tokenizer.encode(template.format(query="what is a cache", document="a cat"))
    got = [s[0] for s in run(e, pairs, "rank")]
    for ids, score in zip(pairs, got):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1, [yes, no]]
        assert abs(score - logits.softmax(-1)[0].item()) < 1e-5
    assert max(got) - min(got) > 1e-3 and all(0 < s < 1 for s in got)

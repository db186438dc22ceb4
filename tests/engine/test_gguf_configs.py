"""A GGUF alone is a runnable model: the config our reader writes from its metadata (as llama.cpp's converter
lays it out, with llama.cpp's defaults where the file says nothing) equals the Hugging Face config it came
from, and the model prepared that way gives Hugging Face's logits."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from minibatch.engine.attention.metadata import build_flat_batch
from minibatch.engine.attention.torch_backend import TorchAttentionBackend
from minibatch.engine.gguf.prepare import model_config, write_config_and_tokenizer
from minibatch.engine.gguf.reader import GGUFFile
from minibatch.engine.gguf.tensors import GGUFError
from minibatch.engine.models.config import ModelConfig
from minibatch.engine.runner.kv_cache import allocate_kv_cache
from minibatch.engine.weights.loader import load_model
from minibatch.kernels.cpu.extension import load_cpu_extension

from ..conftest import TINY_COMMON
from .gguf_models import write_converter_metadata, write_gguf_model

pytestmark = pytest.mark.skipif(load_cpu_extension() is None, reason="the C++ extension cannot be built here")

_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _tiny(path, kind: str):
    """Tiny models whose values llama.cpp's converter either writes or takes by default (so a GGUF says them)."""
    torch.manual_seed(5)
    if kind == "gemma2":  # sliding layers of 8 alternating with global ones, both caps
        cfg = transformers.Gemma2Config(
            **TINY_COMMON,
            **_IDS,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            attn_logit_softcapping=20.0,
            final_logit_softcapping=5.0,
        )
        model = transformers.Gemma2ForCausalLM(cfg)
    elif kind == "gemma3":  # six layers: five sliding, one global; the global rope base and a linear scaling
        cfg = transformers.Gemma3TextConfig(
            **TINY_COMMON | {"num_hidden_layers": 6},
            **_IDS,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            rope_theta=1e6,
            rope_local_base_freq=1e4,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
        )
        model = transformers.Gemma3ForCausalLM(cfg)
    elif kind == "llama3":  # Llama 3.1's rope scaling, written by the converter as rope_freqs.weight
        cfg = transformers.LlamaConfig(
            **TINY_COMMON | {"max_position_embeddings": 256},
            **_IDS,
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        )
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "phi3":  # a window of 8
        cfg = transformers.Phi3Config(**TINY_COMMON, **_IDS, sliding_window=8, tie_word_embeddings=False)
        model = transformers.Phi3ForCausalLM(cfg)
    else:  # phi3-longrope: LongRoPE, its factors stored as tensors; 37 tokens stay below the original 48
        head_half = TINY_COMMON["hidden_size"] // TINY_COMMON["num_attention_heads"] // 2
        rng = np.random.default_rng(0)
        scaling = {
            "rope_type": "longrope",
            "short_factor": (1 + rng.random(head_half)).round(4).tolist(),
            "long_factor": (2 + 4 * rng.random(head_half)).round(4).tolist(),
        }  # as configs write them
        cfg = transformers.Phi3Config(
            **TINY_COMMON | {"max_position_embeddings": 192},
            **_IDS,
            sliding_window=None,
            tie_word_embeddings=False,
            original_max_position_embeddings=48,
            rope_scaling=scaling,
        )
        model = transformers.Phi3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if kind.startswith("gemma") else 1.0, 0.3)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "phi3", "phi3-longrope", "llama3"])
def test_a_gguf_alone_runs_as_the_model_it_came_from(tmp_path, kind):
    arch = "llama" if kind == "llama3" else kind.split("-")[0]
    hf_dir = _tiny(tmp_path / "hf", kind)
    reference = write_gguf_model(hf_dir, tmp_path / "gguf", "Q8_0", arch=arch, metadata=True)
    gguf = tmp_path / "gguf" / "model-Q8_0.gguf"
    model_dir = tmp_path / "prepared"
    model_dir.mkdir()
    assert write_config_and_tokenizer(gguf, model_dir) == "minibatch"
    (model_dir / "minibatch-source.json").write_text(json.dumps({"gguf": str(gguf), "weights_from_gguf": True}))
    ours_cfg, hf_cfg = ModelConfig.from_dir(model_dir), ModelConfig.from_dir(hf_dir)
    assert ours_cfg == hf_cfg
    if kind == "phi3-longrope":
        assert (ours_cfg.rope.rope_type, ours_cfg.max_position, ours_cfg.default_context) == ("longrope", 192, 48)
    if kind == "llama3":
        assert (ours_cfg.rope.rope_type, ours_cfg.rope.factor, ours_cfg.rope.original_max_position) == (
            "llama3",
            8.0,
            8192,
        )

    ids = list(range(5, 5 + 37))
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    hf.load_state_dict(
        {k: v for k, v in reference.items() if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)},
        strict=False,
    )
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    for weights in ("native-exact", "float32"):
        model = load_model(model_dir, TorchAttentionBackend(), weights=weights)
        caches = allocate_kv_cache(model.config, 16, 16)
        batch = build_flat_batch([ids], [0], [[1, 2, 3]], 16)
        with torch.inference_mode():
            got = model.compute_logits(model(batch.input_ids, batch.positions, caches, batch.attn))
        err = (got - expected).abs().max().item()
        assert err < 1e-4, f"{kind} {weights}: max logit difference {err:.2e}"


def _metadata_only(tmp_path, arch: str, cfg: dict, **keys):
    from gguf import GGUFWriter

    path = tmp_path / f"{arch}.gguf"
    writer = GGUFWriter(str(path), arch)
    write_converter_metadata(writer, cfg, arch)
    for key, value in keys.items():
        if isinstance(value, list):
            writer.add_array(f"{arch}.{key}", value)
        else:
            (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(f"{arch}.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(path)


_GEMMA = dict(TINY_COMMON, head_dim=16, sliding_window=8, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)


def test_values_a_file_leaves_out_take_llama_cpps_defaults(tmp_path):
    # Gemma 2 27B (46 layers): queries scaled by 1/sqrt(hidden / heads), not 1/sqrt(head_dim)
    big = model_config(_metadata_only(tmp_path, "gemma2", dict(_GEMMA, num_hidden_layers=46)), 256)
    assert big["query_pre_attn_scalar"] == 64 // 4 and big["head_dim"] == 16
    assert big["layer_types"][:4] == ["sliding_attention", "full_attention"] * 2
    big = model_config(_metadata_only(tmp_path, "gemma2", dict(_GEMMA, num_hidden_layers=46, hidden_size=128)), 256)
    assert big["query_pre_attn_scalar"] == 128 // 4
    # Gemma 3: one global layer in six, local layers on base 10000; a per-layer pattern in the file wins
    g3 = model_config(_metadata_only(tmp_path, "gemma3", dict(_GEMMA, num_hidden_layers=12)), 256)
    assert [t == "full_attention" for t in g3["layer_types"]] == [i % 6 == 5 for i in range(12)]
    assert g3["rope_local_base_freq"] == 1e4 and "attn_logit_softcapping" not in g3
    pattern = [True, False, True, True]
    g3 = model_config(
        _metadata_only(
            tmp_path, "gemma3", dict(_GEMMA, num_hidden_layers=4), **{"attention.sliding_window_pattern": pattern}
        ),
        256,
    )
    assert g3["layer_types"] == ["sliding_attention" if p else "full_attention" for p in pattern]
    # Phi-3 mini 4k files made before the window was written: llama.cpp's 2047; Phi-4 writes 0 (none)
    phi = dict(TINY_COMMON, num_hidden_layers=32, max_position_embeddings=4096)
    f = _metadata_only(tmp_path, "phi3", phi)  # writes sliding_window 0
    assert model_config(f, 256)["sliding_window"] is None
    from gguf import GGUFWriter

    path = tmp_path / "old-phi3.gguf"
    writer = GGUFWriter(str(path), "phi3")
    for key in ("context_length", "embedding_length", "block_count", "feed_forward_length"):
        writer.add_uint32(f"phi3.{key}", {"context_length": 4096, "block_count": 32}.get(key, 64))
    writer.add_uint32("phi3.attention.head_count", 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert model_config(GGUFFile(path), 256)["sliding_window"] == 2047


def test_default_sampling_and_end_tokens_come_from_the_file(tmp_path):
    from gguf import GGUFWriter

    from minibatch.engine.factory import generation_config

    path = tmp_path / "s.gguf"
    writer = GGUFWriter(str(path), "llama")
    for key, value in {
        "context_length": 64,
        "embedding_length": 64,
        "block_count": 2,
        "feed_forward_length": 128,
        "attention.head_count": 4,
    }.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_sampling_temp(0.6)
    writer.add_sampling_top_k(20)
    writer.add_sampling_top_p(0.95)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "<|eot_id|>", "<end_of_turn>", "</s>"])
    writer.add_token_types([1, 1, 3, 3, 3])
    writer.add_token_merges([])
    writer.add_eos_token_id(4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    out = tmp_path / "out"
    out.mkdir()
    write_config_and_tokenizer(path, out)
    stops, defaults = generation_config(out)
    assert stops == {4, 2, 3}
    assert defaults == pytest.approx({"temperature": 0.6, "top_k": 20, "top_p": 0.95})


def test_longrope_factors_that_disagree_with_the_config_are_refused(tmp_path):
    hf_dir = _tiny(tmp_path / "hf", "phi3-longrope")
    write_gguf_model(hf_dir, tmp_path / "gguf", "Q8_0", arch="phi3", metadata=True)
    plain = ModelConfig.from_dir(_tiny(tmp_path / "plain", "phi3"))  # a config with no LongRoPE beside the file
    from minibatch.engine.gguf.tensors import GGUFWeights

    with pytest.raises(
        GGUFError, match=r"LongRoPE factors \(rope_factors_short.weight\) differ from the rope of the config"
    ):
        GGUFWeights(tmp_path / "gguf" / "model-Q8_0.gguf", plain)


def test_rope_freqs_that_are_not_llama3s_scaling_are_refused_not_ignored():
    from types import SimpleNamespace

    from minibatch.engine.gguf.prepare import _llama3_rope, llama3_factors
    from minibatch.engine.models.config import UnsupportedModelError

    file = SimpleNamespace(path="x.gguf")
    config = {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    real = llama3_factors(500000.0, 64, 32.0, 1.0, 4.0, 8192)  # Llama 3.2's numbers, head_dim 64
    _llama3_rope(file, config, real.tolist())
    assert config["rope_parameters"] == {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    untouched = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    _llama3_rope(file, untouched, [1.0] * 32)  # all ones: no scaling
    assert untouched["rope_parameters"]["rope_type"] == "default"
    with pytest.raises(UnsupportedModelError, match="not Llama 3's rope scaling"):
        _llama3_rope(file, {"rope_parameters": {"rope_theta": 10000.0}}, (1 + np.arange(32) / 7).tolist())

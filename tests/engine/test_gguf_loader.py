"""GGUF files read as they are: tiny models written by the tests in every weight type, loaded by our
loader (native and float32), logits against Hugging Face's model holding the dequantised weights."""

from __future__ import annotations

import json
import struct

import pytest
import torch
import transformers

from minibatch.engine.attention.metadata import build_flat_batch
from minibatch.engine.attention.torch_backend import TorchAttentionBackend
from minibatch.engine.gguf.tensors import GGUFError
from minibatch.engine.runner.kv_cache import allocate_kv_cache
from minibatch.engine.weights.loader import load_model
from minibatch.kernels.cpu.extension import load_cpu_extension
from minibatch.kernels.quant_types import INT_DOT_TYPES

from ..conftest import TINY_COMMON
from .gguf_models import write_gguf_model

pytestmark = pytest.mark.skipif(load_cpu_extension() is None, reason="the C++ extension cannot be built here")

# K-quant rows hold 256 values: a tiny model with rows of 256 and 512.
K_SHAPES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def _tiny_hf(path, kind: str, **overrides):
    torch.manual_seed(3)
    common = {**TINY_COMMON, **overrides}
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=True, rope_theta=10000.0)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "mistral":  # a window (8) shorter than the test's 37 tokens
        cfg = transformers.MistralConfig(**common, sliding_window=8, tie_word_embeddings=False, rope_theta=10000.0)
        model = transformers.MistralForCausalLM(cfg)
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True, attention_bias=False)
        model = transformers.Qwen3ForCausalLM(cfg)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
                layer.self_attn.k_norm.weight.normal_(1.0, 0.3)
    elif kind == "phi3":  # fused projections, a window (LongRoPE GGUFs: test_gguf_configs)
        cfg = transformers.Phi3Config(
            **common, sliding_window=8, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2
        )
        model = transformers.Phi3ForCausalLM(cfg)
    elif kind in ("gemma2", "gemma3"):  # sliding layers (8) alternating with global ones; norms that matter
        extra = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8, tie_word_embeddings=True, pad_token_id=0)
        if kind == "gemma2":
            cfg = transformers.Gemma2Config(**common | extra, attn_logit_softcapping=20.0, final_logit_softcapping=5.0)
            model = transformers.Gemma2ForCausalLM(cfg)
        else:
            cfg = transformers.Gemma3TextConfig(**common | extra, sliding_window_pattern=2, rope_local_base_freq=1e4)
            model = transformers.Gemma3ForCausalLM(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.3)
    else:
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=False, rope_theta=10000.0)
        model = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


def _logits(model, ids: list[int]) -> torch.Tensor:
    caches = allocate_kv_cache(model.config, 16, 16)
    batch = build_flat_batch([ids], [0], [[1, 2, 3]], 16)
    with torch.inference_mode():
        return model.compute_logits(model(batch.input_ids, batch.positions, caches, batch.attn))


def _hf_logits(hf_dir, reference: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    state = {k: v for k, v in reference.items() if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
    hf.load_state_dict(state, strict=False)
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


CASES = [
    ("llama", "F32"),
    ("llama", "Q8_0"),
    ("llama", "Q4_1"),
    ("llama", "Q4_0"),
    ("qwen2", "Q8_0"),
    ("qwen2", "Q4_1"),
    ("llama", "Q4_K"),
    ("llama", "Q5_K"),
    ("llama", "Q6_K"),
    ("qwen2", "Q6_K"),
    ("mistral", "Q8_0"),
    ("qwen3", "Q4_1"),
    ("gemma2", "Q8_0"),
    ("gemma3", "Q4_1"),
    ("phi3", "Q4_1"),
]


# 8-bit activations: on the built-in model's real layer inputs, 1% relative error per 32-value scale and
# 2.5% per 256 (the K-quants'); the tiny models' logits measured 0.03-2.4% off the dequantised model's.
INT8_LOGITS_REL = 0.05


@pytest.mark.parametrize("kind,qtype", CASES)
def test_gguf_model_logits_match_hf_on_the_dequantised_weights(tmp_path, kind, qtype):
    shapes = K_SHAPES if qtype.endswith("_K") else {}
    hf_dir = _tiny_hf(tmp_path / "hf", kind, **shapes)
    reference = write_gguf_model(hf_dir, tmp_path / "gguf", qtype, arch=kind)
    model_dir = tmp_path / "gguf" / f"dir-{qtype}"
    ids = list(range(5, 5 + 37))
    expected = _hf_logits(hf_dir, reference, ids)
    for weights in ("native-exact", "float32"):
        ours = load_model(model_dir, TorchAttentionBackend(), weights=weights)
        assert weights == "float32" or ours.weights_desc.endswith("native-exact")
        got = _logits(ours, ids)
        err = (got - expected).abs().max().item()
        assert err < 1e-4, (
            f"{kind} {qtype} {weights}: max logit difference {err:.2e} (|logits| up to {expected.abs().max():.2f})"
        )
    if qtype not in INT_DOT_TYPES:  # float matrices run with fp32 activations on every path
        return
    # The integer path (the default; each kernel equals its twin in tests/kernels): 8-bit activations, so
    # close to the dequantised model, never equal. (A whole model is not compared with its twins: a 1e-7
    # difference in one layer can move an activation across a rounding step of the next layer's quantization.)
    fast = load_model(model_dir, TorchAttentionBackend(), weights="native")
    assert fast.weights_desc.endswith(" native")
    got = _logits(fast, ids)
    rel = ((got - expected).norm() / expected.norm()).item()
    assert 0 < rel < INT8_LOGITS_REL, f"{kind} {qtype} native: relative logit error {rel:.2e}"


def test_a_file_mixing_types_as_llama_quantize_does_loads_natively(tmp_path):
    """Q4_K_M's mix where rows are not multiples of 256 (Qwen2.5-0.5B): Q5_0 and Q8_0 fallbacks beside Q4_K and
    Q6_K, in one stacked q/k/v and one gate/up whose parts have different block sizes."""
    mix = {
        "q_proj": "Q5_0",
        "k_proj": "Q5_0",
        "v_proj": "Q8_0",
        "o_proj": "Q4_K",
        "gate_proj": "Q5_0",
        "up_proj": "Q4_K",
        "down_proj": "Q6_K",
        "embed_tokens": "Q8_0",
    }
    hf_dir = _tiny_hf(tmp_path / "hf", "qwen2", **K_SHAPES)
    reference = write_gguf_model(hf_dir, tmp_path / "gguf", "Q4_K", arch="qwen2", mix=mix)
    model_dir = tmp_path / "gguf" / "dir-Q4_K-mixed"
    ids = list(range(5, 5 + 37))
    expected = _hf_logits(hf_dir, reference, ids)
    exact = load_model(model_dir, TorchAttentionBackend(), weights="native-exact")
    for types in ("Q4_K", "Q5_0", "Q6_K", "Q8_0"):
        assert types in exact.weights_desc
    assert (_logits(exact, ids) - expected).abs().max().item() < 1e-4
    fast = load_model(model_dir, TorchAttentionBackend(), weights="native")
    got = _logits(fast, ids)
    rel = ((got - expected).norm() / expected.norm()).item()
    assert 0 < rel < INT8_LOGITS_REL, rel


def test_safetensors_model_quantized_at_load_to_q8_0(tiny_llama_dir):
    ids = list(range(3, 40))
    dense = load_model(tiny_llama_dir, TorchAttentionBackend(), weights="float32")
    q8 = load_model(tiny_llama_dir, TorchAttentionBackend(), weights="q8_0")
    assert q8.weights_desc.startswith("Q8_0 native")
    a, b = _logits(dense, ids), _logits(q8, ids)
    # Round-to-nearest 8-bit weights: close to fp32, but not equal (so the quantized path ran).
    assert 0 < (a - b).abs().max() < 0.05 * a.abs().max()


@pytest.fixture
def q41_model(tmp_path):
    hf_dir = _tiny_hf(tmp_path / "hf", "llama")
    write_gguf_model(hf_dir, tmp_path / "gguf", "Q4_1")
    model_dir = tmp_path / "gguf" / "dir-Q4_1"
    return model_dir, tmp_path / "gguf" / "model-Q4_1.gguf"


def test_truncated_gguf_names_the_file_and_the_tensor(q41_model):
    model_dir, path = q41_model
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(GGUFError, match=rf"{path.name}: tensor output_norm.weight needs bytes .* \(truncated\)"):
        load_model(model_dir, TorchAttentionBackend())
    path.write_bytes(data[:200])  # cut inside the header
    with pytest.raises(GGUFError, match=r"header ends early .*truncated"):
        load_model(model_dir, TorchAttentionBackend())


def test_not_a_gguf_file(q41_model):
    model_dir, path = q41_model
    path.write_bytes(b"PK\x03\x04" + bytes(500))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        load_model(model_dir, TorchAttentionBackend())


def _patch_tensor_type(path, tensor: str, new_type: int) -> None:
    data = bytearray(path.read_bytes())
    at = data.index(tensor.encode()) + len(tensor)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, new_type)
    path.write_bytes(bytes(data))


def test_unsupported_type_names_tensor_type_and_the_list(q41_model):
    model_dir, path = q41_model
    _patch_tensor_type(path, "blk.0.ffn_up.weight", 16)  # IQ2_XXS
    with pytest.raises(GGUFError, match=r"blk\.0\.ffn_up\.weight has type IQ2_XXS.*supported: F32, F16, BF16, Q4_0"):
        load_model(model_dir, TorchAttentionBackend())


def test_shape_that_does_not_fit_the_block_size(q41_model):
    model_dir, path = q41_model
    _patch_tensor_type(path, "blk.0.attn_norm.weight", 12)  # Q4_K: blocks of 256 values
    with pytest.raises(
        GGUFError, match=r"blk\.0\.attn_norm\.weight has rows of 64 values, not a multiple of Q4_K's block of 256"
    ):
        load_model(model_dir, TorchAttentionBackend())


def test_unsupported_architecture(q41_model):
    model_dir, path = q41_model
    data = path.read_bytes()
    path.write_bytes(data.replace(b"llama", b"gpt2x", 1))
    with pytest.raises(GGUFError, match=r"architecture 'gpt2x' is not supported"):
        load_model(model_dir, TorchAttentionBackend())


def test_tensor_shape_not_matching_the_config(q41_model):
    model_dir, _ = q41_model
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        GGUFError, match=r"tensor blk\.0\.ffn_\w+\.weight has shape \(\d+, \d+\), the config needs \((96, 64|64, 96)\)"
    ):
        load_model(model_dir, TorchAttentionBackend())

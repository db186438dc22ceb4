"""Tiny models written to GGUF by the tests, as llama.cpp's converter lays them out."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from minibatch.kernels.cpu.quant import dequantize_ref
from minibatch.kernels.quant_types import QUANT_TYPES

from ..kernels.quant_blocks import random_blocks

# Hugging Face name pieces -> GGUF's, for one layer.
LAYER_MAP = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


# Gemma's norms as llama.cpp's converter names them (its post_attention_layernorm follows attention)
GEMMA_LAYER_MAP = {
    **LAYER_MAP,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


# Phi-3 keeps q/k/v and gate/up fused
PHI3_LAYER_MAP = {**LAYER_MAP, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}


# The type llama-quantize writes instead of a 256-value type when a matrix's rows are not a multiple of 256
# (Qwen2.5-0.5B's 896-wide rows, in its Q4_K_M file)
K_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL"}


def gguf_name(hf: str, arch: str = "llama") -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")  # model.layers.N.<module...>.weight|bias
    module = ".".join(parts[3:-1])
    names = GEMMA_LAYER_MAP if arch.startswith("gemma") else PHI3_LAYER_MAP if arch == "phi3" else LAYER_MAP
    return f"blk.{parts[2]}.{names[module]}.{parts[-1]}"


def converter_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's Q/K row permutation, applied to whole rows."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_converter_metadata(writer, cfg: dict, arch: str) -> None:
    """The hyper-parameters llama.cpp's converter writes for `arch` from an HF config, and a 256-token
    byte-level vocabulary (the tiny models' vocab size) with the config's BOS and EOS as control tokens."""
    from gguf import RopeScalingType

    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # transformers 5 keeps Gemma 3's rope per layer type
    if arch != "gemma2":  # the Gemma 2 converter writes no base (llama.cpp's default, 10000)
        writer.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if arch.startswith("gemma"):
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
        writer.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == "gemma3" and rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "llama3":  # as the converter writes Llama 3.1+: the factors, as a tensor
        from minibatch.engine.gguf.prepare import llama3_factors

        dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        factors = llama3_factors(
            rope["rope_theta"],
            dim,
            rope["factor"],
            rope["low_freq_factor"],
            rope["high_freq_factor"],
            rope["original_max_position_embeddings"],
        )
        writer.add_tensor("rope_freqs.weight", factors.astype(np.float32))
    if arch in ("phi3", "mistral"):
        writer.add_sliding_window(cfg.get("sliding_window") or 0)
    if arch == "phi3":
        writer.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
        writer.add_rope_scaling_orig_ctx_len(
            cfg.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
        )
        if rope.get("rope_type") == "longrope":
            writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    alphabet = _byte_alphabet()
    tokens = [alphabet[b] for b in range(256)]
    types = [1] * 256
    for key in ("bos_token_id", "eos_token_id"):
        if isinstance(cfg.get(key), int):
            tokens[cfg[key]], types[cfg[key]] = f"<|{key[:3]}|>", 3
            getattr(writer, f"add_{key}")(cfg[key])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([])


def _byte_alphabet() -> dict[int, str]:
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    mapping = {b: chr(b) for b in printable}
    for extra, b in enumerate(b for b in range(256) if b not in mapping):
        mapping[b] = chr(256 + extra)
    return mapping


def write_gguf_model(
    hf_dir: Path,
    out_dir: Path,
    qtype_name: str,
    arch: str = "llama",
    metadata: bool = False,
    mix: dict[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """Write hf_dir's model as a GGUF whose matrices are `qtype_name`, plus a model dir pointing at it
    (holding hf_dir's config; with `metadata`, the GGUF also carries the converter's metadata).

    Matrices are quantized by gguf's reference quantizer where it has one; K-quants (which
    gguf.quants cannot quantize) get random blocks. `mix` gives other types by name fragment
    ({"v_proj": "Q8_0"}), as llama-quantize's presets mix them, and its fallback where a 256-value type does
    not divide a row (K_FALLBACK). Returns the dequantised weights by HF
    name: the model the GGUF holds, for the reference.
    """
    from gguf import GGMLQuantizationType, GGUFWriter

    cfg = json.loads((hf_dir / "config.json").read_text())
    weights = load_file(hf_dir / "model.safetensors")
    qtype = QUANT_TYPES[qtype_name]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"model-{qtype_name}{'-mixed' if mix else ''}.gguf"
    writer = GGUFWriter(str(path), arch)
    if metadata:
        write_converter_metadata(writer, cfg, arch)
    reference: dict[str, torch.Tensor] = {}
    for i, (name, w) in enumerate(sorted(weights.items())):
        w = w.float()
        if w.dim() == 1:  # norms and biases stay F32, as the converter writes them
            stored = w + 1 if arch.startswith("gemma") and name.endswith("norm.weight") else w  # Gemma's 1 + w
            raw, ref, t = stored.numpy().view(np.uint8).reshape(1, -1), w, QUANT_TYPES["F32"]
        else:
            t = next((QUANT_TYPES[v] for frag, v in (mix or {}).items() if frag in name), qtype)
            if w.shape[1] % t.block_elems:  # llama-quantize's fallback for rows a super-block does not divide
                t = QUANT_TYPES[K_FALLBACK[t.name]]
            if t.name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ4_NL"):
                raw = random_blocks(t, w.shape[0], w.shape[1], seed=i).numpy()
            elif t.name == "F32":
                raw = w.numpy().view(np.uint8)
            else:
                from gguf.quants import quantize

                raw = quantize(w.numpy(), GGMLQuantizationType(t.ggml_id)).view(np.uint8)
            ref = dequantize_ref(torch.from_numpy(np.ascontiguousarray(raw)), t, w.shape[1])
        reference[name] = ref
        if arch in ("llama", "mistral") and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            raw = converter_permute(raw, heads)
        raw = np.ascontiguousarray(raw)
        if t.name == "F32":
            writer.add_tensor(gguf_name(name, arch), raw.view(np.float32).reshape(tuple(w.shape)))
        else:
            writer.add_tensor(gguf_name(name, arch), raw, raw_dtype=GGMLQuantizationType(t.ggml_id))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model_dir = out_dir / f"dir-{qtype_name}{'-mixed' if mix else ''}"
    model_dir.mkdir(exist_ok=True)
    for f in hf_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, model_dir / f.name)
    (model_dir / "minibatch-source.json").write_text(json.dumps({"gguf": str(path), "weights_from_gguf": True}))
    return reference

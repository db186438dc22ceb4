"""Read a GGUF file's tensors in place (memory-mapped) and name them as our model does.

GGUF keeps each weight as llama.cpp's converter wrote it: block-quantized rows,
Hugging Face's names mapped to `blk.N.attn_q.weight` and so on, and, for the
`llama` architecture, the rows of Q and K permuted for llama.cpp's interleaved
rotary embedding. `GGUFWeights` undoes the naming and the permutation, checks
every tensor against the model config, and hands out each tensor either as its
raw blocks (uint8 [N, row_bytes]) or dequantised by `gguf.quants`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from minibatch.engine.gguf.architectures import ARCHITECTURES
from minibatch.engine.gguf.reader import GGUFFile, GGUFFormatError, TensorInfo
from minibatch.engine.models.config import ModelConfig
from minibatch.kernels.cpu.quant import dequantize_ref
from minibatch.kernels.quant_types import QUANT_BY_ID, QUANT_TYPES, QuantType


class GGUFError(ValueError):
    """The GGUF file cannot be used; the message names the file and the problem."""


# Architectures whose Q/K rows llama.cpp's converter permutes.
PERMUTED_ARCHS = ("llama", "mistral")
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Gemma: a norm after attention and two around the MLP; llama.cpp's converter stores every norm as 1 + w.
_GEMMA_LAYER_NAMES = {
    **LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Phi-3: q/k/v and gate/up stored fused, as in its checkpoint
_PHI3_LAYER_NAMES = {**LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "cls.output.weight": "score.weight",  # a reranker's rows (pooling rank: Qwen3-Reranker's yes and no)
}
# Tensors a GGUF may carry that our forward computes itself (rope_freqs: prepare.py reads it as Llama 3's
# rope scaling into the config, and the forward computes the same factors from it).
_IGNORED = ("rope_freqs.weight",)


@dataclass(slots=True)
class GGUFTensor:
    hf_name: str  # Hugging Face's name (q/k/v and gate/up not yet stacked)
    gguf_name: str
    qtype: QuantType
    shape: tuple[int, ...]  # PyTorch order: [out_features, in_features] for a matrix
    raw: np.ndarray  # memory-mapped bytes: [rows, row_bytes] for a matrix
    row_order: np.ndarray | None  # Hugging Face row i is GGUF row row_order[i] (un-permuted Q/K)

    def blocks(self) -> torch.Tensor:
        """The quantized rows, Hugging Face's row order: uint8 [rows, row_bytes], copied out of the map."""
        raw = self.raw if self.row_order is None else self.raw[self.row_order]
        return torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True))

    def dequantized(self) -> torch.Tensor:
        """fp32 values exactly as gguf.quants.dequantize gives them, in Hugging Face's row order."""
        return dequantize_ref(self.blocks(), self.qtype, self.shape[-1]).reshape(self.shape)

    def dequantized_on(self, device: torch.device | str) -> torch.Tensor:
        """The same values computed where they will live (a GPU dequantises its model's blocks itself): the
        blocks travel, 4.5 bits a weight for Q4_K rather than 32."""
        from minibatch.kernels.gguf_dequant import dequantize_torch

        return dequantize_torch(self.blocks().to(device), self.qtype, self.shape[-1]).reshape(self.shape)


class GGUFWeights:
    """The tensors of one GGUF file, keyed by Hugging Face name, checked against `cfg`."""

    def __init__(self, path: str | Path, cfg: ModelConfig) -> None:
        self.path = Path(path)
        try:
            self.file = GGUFFile(self.path)
        except GGUFFormatError as exc:
            raise GGUFError(str(exc)) from exc
        self.architecture = self.file.architecture
        if self.architecture not in ARCHITECTURES:
            raise GGUFError(
                f"{self.path}: architecture {self.architecture or '(none)'!r} is not supported; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        self._check_rope_factors(cfg)
        self.tensors: dict[str, GGUFTensor] = {}
        for info in self.file.tensors:
            if info.name in _IGNORED or info.name.startswith("rope_factors_"):
                continue
            self.tensors[_hf_name(info.name, self.path, self.architecture)] = self._tensor(info, cfg)
        self._check_complete(cfg)

    def _check_rope_factors(self, cfg: ModelConfig) -> None:
        """LongRoPE factors stored as tensors (Phi-3 128k) are what the config's rope must say: the config
        carries them (our preparation writes them there) and the forward reads them from it."""
        if not any(info.name.startswith("rope_factors_") for info in self.file.tensors):
            return
        short = next((info for info in self.file.tensors if info.name == "rope_factors_short.weight"), None)
        ours = np.asarray(cfg.rope.short_factor, dtype=np.float32)
        stored = None
        if short is not None and short.ggml_type == 0:  # F32
            stored = self.file.data(short, 4 * int(np.prod(short.dims))).view(np.float32)
        if cfg.rope.rope_type != "longrope" or stored is None or not np.array_equal(stored, ours):
            raise GGUFError(
                f"{self.path}: its LongRoPE factors (rope_factors_short.weight) differ from the rope of the "
                f"config beside it ({cfg.rope.rope_type}, {len(ours)} short factors)"
            )

    def _tensor(self, info: TensorInfo, cfg: ModelConfig) -> GGUFTensor:
        qtype = QUANT_BY_ID.get(info.ggml_type)
        if qtype is None:
            raise GGUFError(
                f"{self.path}: tensor {info.name} has type {_type_name(info.ggml_type)}, which the CPU kernels do "
                f"not run; supported: {', '.join(QUANT_TYPES)}"
            )
        shape = tuple(reversed(info.dims))  # GGUF lists the innermost dimension first
        while len(shape) > 1 and shape[0] == 1:
            shape = shape[1:]
        k = shape[-1]
        if k % qtype.block_elems:
            raise GGUFError(
                f"{self.path}: tensor {info.name} has rows of {k} values, not a multiple of "
                f"{qtype.name}'s block of {qtype.block_elems}"
            )
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        try:
            raw = self.file.data(info, rows * qtype.row_bytes(k)).reshape(rows, -1)
        except GGUFFormatError as exc:
            raise GGUFError(str(exc)) from exc
        hf_name = _hf_name(info.name, self.path, self.architecture)
        row_order = None
        if self.architecture in PERMUTED_ARCHS and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in hf_name else cfg.num_kv_heads
            row_order = unpermute_rows(rows, heads)
        return GGUFTensor(hf_name, info.name, qtype, shape, raw, row_order)

    def _check_complete(self, cfg: ModelConfig) -> None:
        expected = {
            "model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
            "model.norm.weight": (cfg.hidden_size,),
        }
        if not cfg.tie_word_embeddings:
            expected["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
        if cfg.pooling == "rank":
            expected["score.weight"] = (cfg.score_labels, cfg.hidden_size)
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        per_layer = {
            "input_layernorm.weight": (cfg.hidden_size,),
            "post_attention_layernorm.weight": (cfg.hidden_size,),
            "self_attn.q_proj.weight": (q, cfg.hidden_size),
            "self_attn.k_proj.weight": (kv, cfg.hidden_size),
            "self_attn.v_proj.weight": (kv, cfg.hidden_size),
            "self_attn.o_proj.weight": (cfg.hidden_size, q),
            "mlp.gate_proj.weight": (cfg.intermediate_size, cfg.hidden_size),
            "mlp.up_proj.weight": (cfg.intermediate_size, cfg.hidden_size),
            "mlp.down_proj.weight": (cfg.hidden_size, cfg.intermediate_size),
        }
        if self.architecture == "phi3":  # fused, as llama.cpp stores them
            for name in (
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
                "mlp.gate_proj.weight",
                "mlp.up_proj.weight",
            ):
                del per_layer[name]
            per_layer["self_attn.qkv_proj.weight"] = (q + 2 * kv, cfg.hidden_size)
            per_layer["mlp.gate_up_proj.weight"] = (2 * cfg.intermediate_size, cfg.hidden_size)
        if cfg.qk_norm:
            per_layer["self_attn.q_norm.weight"] = per_layer["self_attn.k_norm.weight"] = (cfg.head_dim,)
        if cfg.sandwich_norms:
            per_layer["pre_feedforward_layernorm.weight"] = per_layer["post_feedforward_layernorm.weight"] = (
                cfg.hidden_size,
            )
        if cfg.qkv_bias:
            per_layer.update(
                {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
            )
        for i in range(cfg.num_layers):
            expected.update({f"model.layers.{i}.{n}": s for n, s in per_layer.items()})
        missing = sorted(set(expected) - set(self.tensors))
        if cfg.tie_word_embeddings:
            expected["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)  # a tied file may still carry one
        unexpected = sorted(set(self.tensors) - set(expected))
        if missing or unexpected:
            parts = (
                [f"missing tensors: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"] if missing else []
            )
            if unexpected:
                parts.append(f"unexpected tensors: {', '.join(self.tensors[n].gguf_name for n in unexpected[:8])}")
            raise GGUFError(f"{self.path}: {'; '.join(parts)}")
        for name, shape in expected.items():
            t = self.tensors.get(name)
            if t is not None and t.shape != shape:
                raise GGUFError(f"{self.path}: tensor {t.gguf_name} has shape {t.shape}, the config needs {shape}")

    def summary(self) -> str:
        """The weight types of the matrices, most common first: e.g. "Q4_1 (+Q8_0 embedding)"."""
        counts: dict[str, int] = {}
        for name, t in self.tensors.items():
            if name.endswith("proj.weight") and ".layers." in name:
                counts[t.qtype.name] = counts.get(t.qtype.name, 0) + 1
        main = "/".join(sorted(counts, key=lambda n: -counts[n])) or "?"
        emb = self.tensors["model.embed_tokens.weight"].qtype.name
        return main if emb == main else f"{main} (+{emb} embedding)"


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's Q/K permutation: HF row (h, s, i) sits at GGUF row (h, i, s)."""
    half = rows // heads // 2
    gguf_index = np.arange(rows).reshape(heads, half, 2)  # GGUF rows, grouped as the converter wrote them
    return np.ascontiguousarray(gguf_index.transpose(0, 2, 1)).reshape(rows)


def _hf_name(gguf_name: str, path: Path, arch: str = "llama") -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA_LAYER_NAMES if arch.startswith("gemma") else _PHI3_LAYER_NAMES if arch == "phi3" else LAYER_NAMES
    parts = gguf_name.split(".")
    if len(parts) >= 4 and parts[0] == "blk" and parts[1].isdigit():
        rest = ".".join(parts[2:])
        if rest in names:
            return f"model.layers.{parts[1]}.{names[rest]}"
        stem, suffix = ".".join(parts[2:-1]), parts[-1]
        if stem in names and suffix in ("weight", "bias"):
            return f"model.layers.{parts[1]}.{names[stem]}.{suffix}"
    raise GGUFError(f"{path}: tensor {gguf_name} is not one the {arch} forward knows")


def _type_name(ggml_type: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(ggml_type).name
    except (ImportError, ValueError):
        return f"#{ggml_type}"

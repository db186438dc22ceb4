"""The loaded model's weights counted as they sit in memory: parameters, bytes, storage types.

Read off the modules the forward actually runs (quantized blocks, packed fp32,
plain tensors), so the figures hold for every weight path (native GGUF
blocks, `--weights float32`, `--weights q8_0`).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from minibatch.engine.core.info import WeightFacts, WeightGroup
from minibatch.engine.encoders.model import EncoderModel
from minibatch.engine.models.llama import LlamaForCausalLM, RMSNorm
from minibatch.engine.weights.cpu_linear import PackedLinear
from minibatch.engine.weights.quant_linear import QuantEmbedding, QuantLinear, StackedLinear

_DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def _stored(module: nn.Module) -> list[tuple[str, torch.Tensor, int]]:
    """(storage type, tensor, parameter count) of every tensor a projection or embedding reads."""
    if isinstance(module, StackedLinear):
        return [t for part in module.parts for t in _stored(part)]
    if isinstance(module, (QuantLinear, QuantEmbedding)):
        cols = module.in_features if isinstance(module, QuantLinear) else module.dim
        out = [(module.qtype.name, module.blocks, module.blocks.shape[0] * cols)]
    elif isinstance(module, PackedLinear):
        out = [("F32", module.packed, module.in_features * module.out_features)]
    elif isinstance(module, (nn.Linear, nn.Embedding)):
        out = [(_DTYPE_NAMES.get(module.weight.dtype, str(module.weight.dtype)), module.weight, module.weight.numel())]
    else:
        raise TypeError(f"no weight accounting for {type(module).__name__}")
    bias = getattr(module, "bias", None)
    if isinstance(bias, torch.Tensor):
        out.append((_DTYPE_NAMES.get(bias.dtype, str(bias.dtype)), bias, bias.numel()))
    return out


def _key(t: torch.Tensor) -> int:
    """Identity of a tensor's memory (packed oneDNN tensors have no storage to point at)."""
    return id(t) if t.is_mkldnn else t.untyped_storage().data_ptr()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def weight_facts(model: LlamaForCausalLM | EncoderModel) -> WeightFacts:
    """Count what `model` holds and what one decode step's matmuls stream."""
    groups: dict[str, dict] = defaultdict(lambda: {"params": 0, "bytes": 0, "types": defaultdict(int)})
    seen: set[int] = set()
    num_params = loaded = 0

    def add(group: str, tensors: list[tuple[str, torch.Tensor, int]]) -> None:
        nonlocal num_params, loaded
        g = groups[group]
        for type_name, t, params in tensors:
            g["params"] += params
            g["bytes"] += _nbytes(t)
            g["types"][type_name] += params
            if _key(t) not in seen:  # a tied output projection reads the embedding's blocks
                seen.add(_key(t))
                num_params += params
                loaded += _nbytes(t)

    for table in model.embedding_tables():
        add("embedding", _stored(table))
    streamed = matmul_params = 0
    for group, module in model.projections():
        tensors = _stored(module)
        add(group, tensors)
        streamed += sum(_nbytes(t) for _, t, _ in tensors)
        matmul_params += sum(p for _, t, p in tensors if t.dim() == 2 or t.is_mkldnn)
    norms = [m for m in model.modules() if isinstance(m, (RMSNorm, nn.LayerNorm))]
    tensors = [t for m in norms for t in (m.weight, m.bias if isinstance(m, nn.LayerNorm) else None) if t is not None]
    add("norms", [(_DTYPE_NAMES.get(t.dtype, str(t.dtype)), t, t.numel()) for t in tensors])
    return WeightFacts(
        num_params=num_params,
        loaded_bytes=loaded,
        matmul_bytes_per_step=streamed,
        matmul_params=matmul_params,
        groups=tuple(WeightGroup(name, g["params"], g["bytes"], dict(g["types"])) for name, g in groups.items()),
    )

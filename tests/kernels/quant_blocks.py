"""Random GGUF blocks of every supported type, with finite, model-sized scales."""

from __future__ import annotations

import numpy as np
import torch

from minibatch.kernels.quant_types import QuantType

# Byte offsets of each block's fp16 scale fields.
SCALE_OFFSETS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "IQ4_NL": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "IQ4_XS": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


# fp16 scale ranges that give weights of a trained model's size (|w| up to ~0.1): the super-block
# scale of a K-quant multiplies a 6- or 8-bit sub-block scale as well as the quant.
SCALE_RANGE = {
    "Q4_0": (2e-3, 3e-2),
    "Q4_1": (2e-3, 3e-2),
    "Q5_0": (1e-3, 1.5e-2),
    "Q5_1": (1e-3, 1.5e-2),
    "Q8_0": (2e-4, 1e-3),
    "IQ4_NL": (2e-4, 1e-3),
    "Q2_K": (1e-3, 3e-3),
    "Q3_K": (3e-4, 8e-4),
    "IQ4_XS": (1e-5, 3e-5),
    "Q4_K": (5e-5, 2e-4),
    "Q5_K": (3e-5, 1e-4),
    "Q6_K": (1e-5, 4e-5),
}


def random_blocks(qtype: QuantType, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 [n, row_bytes]: random quants, scales drawn so the weights are model-sized."""
    rng = np.random.default_rng(seed)
    if qtype.name in ("F32", "F16", "BF16"):
        values = rng.standard_normal((n, k)).astype(np.float32)
        if qtype.name == "F32":
            raw = values.view(np.uint8)
        elif qtype.name == "F16":
            raw = values.astype(np.float16).view(np.uint8)
        else:
            raw = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return torch.from_numpy(np.ascontiguousarray(raw).reshape(n, -1))
    nblocks = n * k // qtype.block_elems
    raw = rng.integers(0, 256, size=(nblocks, qtype.block_bytes), dtype=np.uint8)
    for i, off in enumerate(SCALE_OFFSETS[qtype.name]):
        lo, hi = SCALE_RANGE[qtype.name]
        scale = rng.uniform(lo, hi, size=nblocks) * (rng.choice([-1, 1], size=nblocks) if i else 1)
        raw[:, off : off + 2] = scale.astype(np.float16).view(np.uint8).reshape(nblocks, 2)
    return torch.from_numpy(raw.reshape(n, -1))

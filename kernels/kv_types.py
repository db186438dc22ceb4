"""The KV cache's storage types, defined once: their names, what a row of one head takes, and their PyTorch
twins (the reference the C++ and Triton stores and readers are tested against).

A cache tensor's dtype says its type: fp32, fp16 or bf16 rows of head_dim values, or uint8 rows of head_dim / 32
Q8_0 blocks — an fp16 scale and 32 int8 quants, 34 bytes each, llama.cpp's block_q8_0 and GGUF's Q8_0 byte for
byte (8.5 bits a value, as llama.cpp's `-ctk q8_0`).

Light to import (the CLI reads the names): torch is imported by the functions that need it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0")
QK8_0 = 32  # values per Q8_0 block
Q8_0_BYTES = 34  # bytes per Q8_0 block: the fp16 scale, then 32 int8
_ELEMENT_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 1}  # of the tensor holding the type


def _storage() -> dict:
    import torch

    return {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "q8_0": torch.uint8}


@dataclass(frozen=True, slots=True)
class KVCacheTypes:
    """The types K and V are kept in (llama.cpp's -ctk / -ctv)."""

    k: str
    v: str

    @classmethod
    def parse(cls, text: str, field: str = "kv_cache_type") -> KVCacheTypes:
        """`TYPE` for both, or `K_TYPE,V_TYPE`; an error naming the field and the types there are."""
        parts = [p.strip() for p in str(text).split(",")]
        if len(parts) not in (1, 2):
            raise ValueError(
                f"{field}: a type or K_TYPE,V_TYPE, got {text!r}; the types are {', '.join(KV_CACHE_TYPES)}"
            )
        return cls(check_type(parts[0], field), check_type(parts[-1], field))

    @classmethod
    def of_dtype(cls, dtype: torch.dtype) -> KVCacheTypes:
        """Both in the type of a model dtype (f32, f16, bf16)."""
        name = {str(v): k for k, v in _storage().items()}[str(dtype)]
        return cls(name, name)

    def __str__(self) -> str:
        return self.k if self.k == self.v else f"{self.k},{self.v}"


class PagedKV(NamedTuple):
    """One layer's paged cache: K and V, each [num_blocks, block_size, num_kv_heads, row] in its own type.
    Indexing it as kv[0] / kv[1] gives K / V, as a [2, num_blocks, ...] tensor of one type does."""

    k: torch.Tensor
    v: torch.Tensor

    def clone(self) -> PagedKV:
        return PagedKV(self.k.clone(), self.v.clone())


def storage_dtype(kv_type: str) -> torch.dtype:
    return _storage()[check_type(kv_type)]


def check_type(kv_type: str, field: str = "kv_cache_type") -> str:
    if kv_type not in KV_CACHE_TYPES:
        raise ValueError(f"{field}: {kv_type!r} is not a KV cache type; the types are {', '.join(KV_CACHE_TYPES)}")
    return kv_type


def type_problem(kv_type: str, head_dim: int) -> str | None:
    """Why a model whose heads have head_dim values cannot keep its cache in kv_type, or None."""
    if kv_type == "q8_0" and head_dim % QK8_0:
        return f"q8_0 needs head_dim a multiple of {QK8_0}; this model's heads have {head_dim}"
    return None


def row_width(kv_type: str, head_dim: int) -> int:
    """The last dimension of a cache tensor of this type: values, or bytes for q8_0."""
    if check_type(kv_type) == "q8_0":
        problem = type_problem(kv_type, head_dim)
        if problem:
            raise ValueError(problem)
        return head_dim // QK8_0 * Q8_0_BYTES
    return head_dim


def row_bytes(kv_type: str, head_dim: int) -> int:
    """Bytes one token's row of one KV head takes."""
    return row_width(kv_type, head_dim) * _ELEMENT_BYTES[kv_type]


def type_of(cache: torch.Tensor) -> str:
    """The type a cache tensor holds."""
    name = {dtype: name for name, dtype in _storage().items()}.get(cache.dtype)
    if name is None:
        raise ValueError(f"a KV cache holds {', '.join(KV_CACHE_TYPES)}; got a {cache.dtype} tensor")
    return name


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf (halves away from zero), exactly, as gguf.quants rounds."""

    a = x.abs()
    floored = a.floor()
    return x.sign() * (floored + (2 * (a - floored)).floor())


def quantize_q8_0_ref(x: torch.Tensor) -> torch.Tensor:
    """fp32 [..., head_dim] -> uint8 [..., head_dim / 32 * 34]: GGUF's reference Q8_0 quantizer."""
    import torch

    blocks = x.float().reshape(*x.shape[:-1], -1, QK8_0)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    qs = _roundf(blocks * inv).to(torch.int8).view(torch.uint8)
    scale = d.half().view(torch.uint8).reshape(*d.shape[:-1], 2)
    return torch.cat([scale, qs], -1).reshape(*x.shape[:-1], -1)


def dequantize_q8_0_ref(rows: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n * 34] -> fp32 [..., n * 32]."""
    import torch

    blocks = rows.reshape(*rows.shape[:-1], -1, Q8_0_BYTES)
    d = blocks[..., :2].contiguous().view(torch.float16).float()
    qs = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (qs * d).reshape(*rows.shape[:-1], -1)


def to_cache_ref(x: torch.Tensor, kv_type: str) -> torch.Tensor:
    """fp32 rows [..., head_dim] in a cache type's storage (the stores' twin)."""
    if kv_type == "q8_0":
        return quantize_q8_0_ref(x)
    return x.to(storage_dtype(kv_type))


def from_cache_ref(rows: torch.Tensor) -> torch.Tensor:
    """A cache's rows as fp32 [..., head_dim] (the readers' twin): exact for every type."""
    import torch

    if rows.dtype == torch.uint8:
        return dequantize_q8_0_ref(rows)
    return rows.float()

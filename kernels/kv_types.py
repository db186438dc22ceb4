"""The KV cache's storage types, defined once: their names, what a row of one head takes, and their PyTorch
twins (the reference the C++ and Triton stores and readers are tested against).

fp32, fp16 and bf16 rows hold head_dim values. The block types keep each 32 values of a row as one of GGUF's
blocks, llama.cpp's block layouts byte for byte (its `-ctk` / `-ctv` types), so a row is head_dim / 32 blocks:

| type   | bytes | a block                                                   | a value               |
|--------|------:|-----------------------------------------------------------|-----------------------|
| q8_0   | 34    | fp16 d, 32 int8                                           | q * d                 |
| q5_1   | 24    | fp16 d, fp16 m, 32 high bits, 16 bytes of low nibbles     | q * d + m (q in 0..31)|
| q5_0   | 22    | fp16 d, 32 high bits, 16 bytes of low nibbles             | (q - 16) * d          |
| q4_1   | 20    | fp16 d, fp16 m, 16 bytes of nibbles                       | q * d + m (q in 0..15)|
| q4_0   | 18    | fp16 d, 16 bytes of nibbles                               | (q - 8) * d           |
| iq4_nl | 18    | fp16 d, 16 bytes of nibbles, each an index into 16 levels | level[q] * d          |

(byte j's low nibble is value j, its high nibble value j + 16.) Each is written by llama.cpp's reference
quantizer of the type, the one its CPU backend runs when it stores K and V.

The 4- and 5-bit types hold rows turned by a Walsh-Hadamard rotation first, as llama.cpp does for its quantized
caches: a head's K in pieces of the largest power of two from 64 that divides head_dim, V in pieces of 64 (heads
that are not a multiple of 64 are kept as they are). The rotation is orthonormal and its own inverse, so a query
turned the same way scores the same against a turned key, and an output computed from turned values is turned
back; what it changes is the quantization: a block no longer holds one outlier beside 31 small values (the
rotation spreads every value over the whole piece), which is what costs 4 bits most. q8_0 is kept unturned (its
error is within 0.1% of f32's perplexity without it). A cache tensor's dtype says its type:
a float dtype its own; uint8 the block types told apart by their bytes per block (the row's width over
head_dim / 32); int8 iq4_nl, whose blocks are q4_0's size.

Light to import (the CLI reads the names): torch is imported by the functions that need it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl")
FLOAT_TYPES = ("f32", "f16", "bf16")
BLOCK_VALUES = 32  # values per block of every block type
BLOCK_BYTES = {"q8_0": 34, "q5_1": 24, "q5_0": 22, "q4_1": 20, "q4_0": 18, "iq4_nl": 18}
QK8_0 = BLOCK_VALUES
Q8_0_BYTES = BLOCK_BYTES["q8_0"]
IQ4_NL_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # GGUF's table
ROTATED_TYPES = ("q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl")
ROTATION_MIN = 64  # values per piece of the rotation: the smallest, and V's
_BY_BLOCK_BYTES = {b: name for name, b in BLOCK_BYTES.items() if name != "iq4_nl"}  # uint8 caches
_ELEMENT_BYTES = {"f32": 4, "f16": 2, "bf16": 2} | {name: 1 for name in BLOCK_BYTES}  # of the tensor holding it


def _storage() -> dict:
    import torch

    floats = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
    return floats | {name: torch.int8 if name == "iq4_nl" else torch.uint8 for name in BLOCK_BYTES}


def is_block_type(kv_type: str) -> bool:
    return kv_type in BLOCK_BYTES


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
        name = {str(_storage()[t]): t for t in FLOAT_TYPES}[str(dtype)]
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
    if is_block_type(kv_type) and head_dim % BLOCK_VALUES:
        return f"{kv_type} needs head_dim a multiple of {BLOCK_VALUES}; this model's heads have {head_dim}"
    return None


def row_width(kv_type: str, head_dim: int) -> int:
    """The last dimension of a cache tensor of this type: values, or bytes for a block type."""
    if is_block_type(check_type(kv_type)):
        problem = type_problem(kv_type, head_dim)
        if problem:
            raise ValueError(problem)
        return head_dim // BLOCK_VALUES * BLOCK_BYTES[kv_type]
    return head_dim


def row_bytes(kv_type: str, head_dim: int) -> int:
    """Bytes one token's row of one KV head takes."""
    return row_width(kv_type, head_dim) * _ELEMENT_BYTES[kv_type]


def type_of(cache: torch.Tensor, head_dim: int) -> str:
    """The type a cache tensor (or rows of one) holds, for heads of head_dim values."""
    import torch

    name = {v: k for k, v in _storage().items() if k in FLOAT_TYPES or k == "iq4_nl"}.get(cache.dtype)
    if cache.dtype == torch.uint8 and head_dim % BLOCK_VALUES == 0:
        name = _BY_BLOCK_BYTES.get(cache.shape[-1] * BLOCK_VALUES // head_dim)
    if name is None or cache.shape[-1] != row_width(name, head_dim):
        raise ValueError(
            f"a KV cache holds {', '.join(KV_CACHE_TYPES)}; a {cache.dtype} tensor of rows {cache.shape[-1]} "
            f"wide is none of them for heads of {head_dim}"
        )
    return name


def rotation(kv_type: str, head_dim: int, role: str) -> int:
    """The size of the pieces a K (role "k") or V ("v") row of this type is rotated in before it is stored; 0: not
    rotated. The attention kernels and every twin follow this rule."""
    if kv_type not in ROTATED_TYPES or head_dim % ROTATION_MIN:
        return 0
    n = ROTATION_MIN
    while role == "k" and head_dim % (2 * n) == 0:
        n *= 2
    return n


def hadamard_ref(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., D] turned in pieces of n values (n a power of two dividing D) by the orthonormal Walsh-Hadamard
    matrix, its own inverse: the in-place butterfly, (a, b) -> (a + b, a - b) at strides 1, 2, .. n / 2, then
    times 1 / sqrt(n) rounded to fp32 (exact for 64). The C++ kernel's twin, operation for operation."""
    import math

    import torch

    if not n:
        return x
    shape, y = x.shape, x.float()
    h = 1
    while h < n:
        pairs = y.reshape(*shape[:-1], -1, 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), -2).reshape(shape)
        h *= 2
    return y * (1 / math.sqrt(n))


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf (halves away from zero), exactly, as gguf.quants rounds."""

    a = x.abs()
    floored = a.floor()
    return x.sign() * (floored + (2 * (a - floored)).floor())


def _half_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp32 [...] -> its fp16's two bytes [..., 2], little end first (round to nearest even, as GGML_FP32_TO_FP16)."""
    import torch

    return x.half().view(torch.uint8).reshape(*x.shape, 2) if x.dim() else x.half().view(torch.uint8)


def _signed_max(blocks: torch.Tensor) -> torch.Tensor:
    """Each block's value of the largest magnitude, sign kept, the first of equals (llama.cpp's `amax < |v|`)."""
    return blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True)).squeeze(-1)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """[..., 32] small integers -> [..., 16] bytes: value j in byte j's low nibble, value j + 16 in its high."""
    import torch

    q = q.to(torch.uint8)
    return (q[..., :16] & 0x0F) | ((q[..., 16:] & 0x0F) << 4)


def _high_bits(q: torch.Tensor) -> torch.Tensor:
    """[..., 32] five-bit values -> their fifth bits as one little-endian uint32, in 4 bytes."""
    import torch

    bits = ((q.to(torch.int64) >> 4) & 1) << torch.arange(32, device=q.device)
    return bits.sum(-1).to(torch.int32).view(torch.uint8).reshape(*q.shape[:-1], 4)


def _iq4_index(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """GGUF's best_index_int8 over the 16 levels: the nearest, the lower of a tie's two."""
    import torch

    upper = (levels <= x[..., None]).sum(-1).clamp(1, 15)
    lo, hi = levels[upper - 1], levels[upper]
    pick = torch.where(x - lo < hi - x, upper - 1, upper)
    return torch.where(x <= levels[0], 0, torch.where(x >= levels[15], 15, pick))


def quantize_ref(x: torch.Tensor, kv_type: str) -> torch.Tensor:
    """fp32 [..., head_dim] -> [..., head_dim / 32 * bytes] blocks of a block type: llama.cpp's reference
    quantizer of it (quantize_row_<type>_ref; gguf.quants' for every type it has), the arithmetic in fp32 as there.

    iq4_nl: the scale is the least-squares fit of the block to the levels it rounds to at d = max / -127 (the
    reference's one pass, no search); a block of zeros (|x| < 1e-15) is d = 0 and index 0 everywhere."""
    import torch

    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK_VALUES)
    if kv_type == "q8_0":
        d = blocks.abs().amax(-1) / 127
        q = _roundf(blocks * _inverse(d)[..., None]).to(torch.int8).view(torch.uint8)
        parts = [_half_bytes(d), q]
    elif kv_type in ("q4_0", "q5_0"):
        top = 8 if kv_type == "q4_0" else 16
        d = _signed_max(blocks) / -top
        q = (blocks * _inverse(d)[..., None] + (top + 0.5)).trunc().clamp(max=2 * top - 1)
        parts = [_half_bytes(d), *([_high_bits(q)] if kv_type == "q5_0" else []), _nibbles(q)]
    elif kv_type in ("q4_1", "q5_1"):
        low, high = blocks.amin(-1), blocks.amax(-1)
        top = 15 if kv_type == "q4_1" else 31
        d = (high - low) / top
        q = ((blocks - low[..., None]) * _inverse(d)[..., None] + 0.5).trunc().clamp(max=top)
        parts = [_half_bytes(d), _half_bytes(low), *([_high_bits(q)] if kv_type == "q5_1" else []), _nibbles(q)]
    elif kv_type == "iq4_nl":
        levels = torch.tensor(IQ4_NL_LEVELS, dtype=torch.float32, device=x.device)
        top = _signed_max(blocks)
        index = _iq4_index(blocks * (1 / (top / levels[0]))[..., None], levels)
        q = levels[index]
        sum_qx = torch.zeros_like(top)
        sum_q2 = torch.zeros_like(top)
        for j in range(BLOCK_VALUES):  # one value after another, as the reference sums
            w = blocks[..., j] * blocks[..., j]
            sum_qx = sum_qx + w * q[..., j] * blocks[..., j]
            sum_q2 = sum_q2 + w * q[..., j] * q[..., j]
        d = torch.where(sum_q2 > 0, sum_qx / sum_q2, torch.zeros_like(sum_qx))
        zero = blocks.abs().amax(-1) < 1e-15
        d = torch.where(zero, torch.zeros_like(d), d)
        index = torch.where(zero[..., None], torch.zeros_like(index), index)
        parts = [_half_bytes(d), _nibbles(index)]
    else:
        raise ValueError(f"{kv_type!r} is not a block type; they are {', '.join(BLOCK_BYTES)}")
    out = torch.cat(parts, -1).reshape(*x.shape[:-1], -1)
    return out.view(torch.int8) if kv_type == "iq4_nl" else out


def dequantize_ref(rows: torch.Tensor, kv_type: str) -> torch.Tensor:
    """[..., n * bytes] blocks -> fp32 [..., n * 32], as the readers compute them: q * d in fp32 (exact: a small
    integer times an fp16), then + m for the types with a minimum (one fp32 rounding, no fused multiply-add)."""
    import torch

    blocks = rows.view(torch.uint8).reshape(*rows.shape[:-1], -1, BLOCK_BYTES[kv_type])

    def half(at: int) -> torch.Tensor:
        return blocks[..., at : at + 2].contiguous().view(torch.float16).float()

    if kv_type == "q8_0":
        q, d = blocks[..., 2:].contiguous().view(torch.int8).float(), half(0)
        return (q * d).reshape(*rows.shape[:-1], -1)
    with_min = kv_type in ("q4_1", "q5_1")
    packed = blocks[..., -16:].to(torch.int32)
    q = torch.cat([packed & 0x0F, packed >> 4], -1)
    if kv_type in ("q5_0", "q5_1"):
        at = 4 if with_min else 2
        high = blocks[..., at : at + 4].contiguous().view(torch.int32)
        q = q | (((high >> torch.arange(32, device=rows.device)) & 1) << 4)
    if kv_type == "iq4_nl":
        q = torch.tensor(IQ4_NL_LEVELS, dtype=torch.int32, device=rows.device)[q]
    elif not with_min:
        q = q - (8 if kv_type == "q4_0" else 16)
    x = q.float() * half(0)
    if with_min:
        x = x + half(2)
    return x.reshape(*rows.shape[:-1], -1)


def quantize_q8_0_ref(x: torch.Tensor) -> torch.Tensor:
    """fp32 [..., head_dim] -> uint8 [..., head_dim / 32 * 34]: GGUF's reference Q8_0 quantizer."""
    return quantize_ref(x, "q8_0")


def dequantize_q8_0_ref(rows: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n * 34] -> fp32 [..., n * 32]."""
    return dequantize_ref(rows, "q8_0")


def store_ref(x: torch.Tensor, kv_type: str, role: str) -> torch.Tensor:
    """New K (role "k") or V ("v") rows [..., head_dim] as the cache keeps them: rotated where the type is, then
    in its storage (the stores' twin)."""
    return to_cache_ref(hadamard_ref(x.float(), rotation(kv_type, x.shape[-1], role)), kv_type)


def to_cache_ref(x: torch.Tensor, kv_type: str) -> torch.Tensor:
    """fp32 rows [..., head_dim] in a cache type's storage, as they are (store_ref rotates first)."""
    if is_block_type(kv_type):
        return quantize_ref(x, kv_type)
    return x.to(storage_dtype(kv_type))


def from_cache_ref(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A cache's rows as fp32 [..., head_dim] (the readers' twin), for heads of head_dim values."""
    kv_type = type_of(rows, head_dim)
    if is_block_type(kv_type):
        return dequantize_ref(rows, kv_type)
    return rows.float()

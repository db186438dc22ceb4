"""The Triton kernels the GPU engine launches, compiled for one NVIDIA architecture in the configurations the
engine uses: `python -m tests.kernels.gpu_compile_cases ARCH` prints one JSON line per kernel and
configuration. Run as its own process: Triton's interpreter (TRITON_INTERPRET, which the kernel tests set)
must not be on when the kernels are defined."""

from __future__ import annotations

import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from minibatch.kernels.gpu import kv_store, logit_edits, lora, paged_attention, paged_decode, sampling
from minibatch.kernels.gpu.paged_decode import SPLIT
from minibatch.kernels.gpu.paged_rows import ATTENTION_WARPS, KIND, key_tile
from minibatch.kernels.kv_types import BLOCK_BYTES

STRIDES = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb", "stride_ks", "stride_kh")
STRIDES += ("stride_vb", "stride_vs", "stride_vh", "stride_bt")
# (query type, K cache, V cache): bf16 and f16 caches with their queries, q8_0 beside bf16, the 4- and 5-bit
# block types (every loader branch: q4_0 and iq4_nl's nibbles, q5_1's and q5_0's fifth bits), f32 with f32
CACHES = [("bf16", "bf16", "bf16"), ("fp16", "fp16", "fp16"), ("bf16", "q8_0", "q8_0"), ("bf16", "q8_0", "bf16")]
CACHES += [("bf16", "q4_0", "iq4_nl"), ("fp16", "q5_1", "q5_0"), ("fp32", "fp32", "fp32")]


def pointer(cache: str) -> str:
    """A cache's pointer type: a float type its own, a block type's bytes (iq4_nl's an int8 tensor)."""
    return "*i8" if cache == "iq4_nl" else "*u8" if cache in KIND else f"*{cache}"


def compile_for(fn, types: dict[str, str], consts: dict, arch: int, num_warps: int = 4) -> None:
    """As a launch specialises it: pointers and strides divisible by 16 (the block table's width is not)."""
    names = fn.arg_names
    signature = {n: "constexpr" if n in consts else types[n] for n in names}
    aligned = [n for n in names if n not in consts and (types[n][0] == "*" or n.startswith("stride_"))]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned if n != "stride_bt"}
    constexprs = {(names.index(k),): v for k, v in consts.items()}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    if not kernel.asm.get("cubin"):
        raise RuntimeError("no cubin")


def attention_types(q: str, k: str, v: str) -> dict[str, str]:
    return {
        "q_ptr": f"*{q}",
        "k_cache_ptr": pointer(k),
        "v_cache_ptr": pointer(v),
        "block_tables_ptr": "*i32",
        "query_start_ptr": "*i32",
        "seq_lens_ptr": "*i32",
        "scale": "fp32",
        "window": "i32",
        "softcap": "fp32",
        **dict.fromkeys(STRIDES, "i32"),
    }


def attention_consts(q: str, k: str, v: str, softcap: bool, head_dim: int) -> dict:
    return {
        "HEAD_DIM": head_dim,
        "BLOCK_SIZE": 16,
        "BLOCK_N": key_tile(16, head_dim),
        "SPLIT": SPLIT,
        "FP32_DOT": q == "fp32",
        "SOFTCAP": softcap,
        "K_KIND": KIND.get(k, 0),
        "V_KIND": KIND.get(v, 0),
    }


def cases():
    """(name, kernel, argument types, constexprs, warps) of every configuration checked."""
    sampler = {
        "tokens_ptr": "*i64",
        "cuts_ptr": "*i64",
        "logits_ptr": "*fp32",
        "masks_ptr": "*i32",
        "settings_ptr": "*fp64",
        "streams_ptr": "*i64",
        "cand_ptr": "*i32",
        "V": "i32",
        "stride_l": "i32",
        "stride_m": "i32",
    }
    for has_mask in (False, True):
        consts = {"HAS_MASK": has_mask, "BLOCK": 1024, "NT": sampling.NT, "CAP": sampling.CAP}
        yield f"sampler mask={has_mask}", sampling._sample_kernel, sampler, consts, sampling.WARPS
    edits = {
        "logits_ptr": "*fp32",
        "stride_l": "i32",
        "rows_ptr": "*i64",
        "tokens_ptr": "*i64",
        "values_ptr": "*fp32",
        "start": "i32",
        "n": "i32",
    }
    for scale in (False, True):
        yield f"edits scale={scale}", logit_edits._edit_kernel, edits, {"SCALE": scale, "CLAMP": scale, "BLOCK": 256}, 4
    merge = {
        "part_out_ptr": "*fp32",
        "part_ml_ptr": "*fp32",
        "query_start_ptr": "*i32",
        "seq_lens_ptr": "*i32",
        "stride_ot": "i32",
        "stride_oh": "i32",
        "num_heads": "i32",
        "max_splits": "i32",
    }
    for act in ("bf16", "fp32"):
        lora_types = {"y_ptr": f"*{act}", "x_ptr": f"*{act}", "a_ptr": "*fp16", "bt_ptr": "*fp16"}
        lora_types |= {"ranks_ptr": "*i32", "slots_ptr": "*i32", "scales_ptr": "*fp32"}
        lora_types |= {"stride_y": "i32", "stride_x": "i32", "IN": "i32", "OUT": "i32", "R": "i32"}
        consts = {"K": 2, "BLOCK_R": 16, "BLOCK_IN": lora.BLOCK_IN, "BLOCK_OUT": lora.BLOCK_OUT}
        yield f"lora {act}", lora._lora_kernel, lora_types, consts, 4
    store = {"x_ptr": "*bf16", "cache_ptr": "*u8", "slot_ptr": "*i64", "stride_x": "i32", "stride_c": "i32"}
    for name, kind in KIND.items():  # a token's K of 2 heads of 128: 8 blocks
        consts = {"BLOCKS": 8, "BLOCKS_P2": 8, "KIND": kind, "NB": BLOCK_BYTES[name]}
        yield f"store {name}", kv_store._store_blocks_kernel, store, consts, 4
    for (q, k, v), head_dim in [(c, 128) for c in CACHES] + [(("bf16", "bf16", "bf16"), 256)]:
        split = attention_types(q, k, v) | {"part_out_ptr": "*fp32", "part_ml_ptr": "*fp32", "max_splits": "i32"}
        for group, softcap in ((4, False), (8, True)):
            consts = attention_consts(q, k, v, softcap, head_dim) | {"GROUP": group, "BLOCK_G": 16}
            name = f"decode split {q}/{k}/{v} x{head_dim} group={group}"
            yield name, paged_decode._decode_split_kernel, split, consts, ATTENTION_WARPS
        out = merge | {"out_ptr": f"*{q}"}
        consts = {"HEAD_DIM": head_dim, "SPLIT": SPLIT}
        yield f"decode merge {q} x{head_dim}", paged_decode._decode_merge_kernel, out, consts, 4
        prefill = attention_types(q, k, v) | {"out_ptr": f"*{q}", "spans_ptr": "*i32"}
        images = k != v or head_dim == 256  # rows of whole images (Gemma 3's) in some of the configurations
        consts = attention_consts(q, k, v, q == "bf16", head_dim) | {"GROUP": 4, "BLOCK_M": 16, "SKIP_DECODE": True}
        consts["IMAGES"] = images
        yield (
            f"prefill {q}/{k}/{v} x{head_dim}{' images' if images else ''}",
            paged_attention._paged_attention_kernel,
            prefill,
            consts,
            ATTENTION_WARPS,
        )


def main(arch: int) -> None:
    for name, fn, types, consts, warps in cases():
        try:
            compile_for(fn, types, consts, arch, warps)
            print(json.dumps({"case": name, "ok": True}), flush=True)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, the others still compiled
            print(json.dumps({"case": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))

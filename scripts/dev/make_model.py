"""Write a random-weight GGUF in the exact shape of a named model, to measure at realistic sizes offline.

  .venv/bin/python scripts/dev/make_model.py --shape llama-3.2-1b --out models/llama1b-f16.gguf
  .venv/bin/python scripts/dev/make_model.py --shape qwen2.5-0.5b --out models/qwen05b.gguf \\
      --llama-quantize /path/to/llama-quantize --quantize Q4_K_M      # exactly the type mix of a real file
  .venv/bin/python scripts/dev/make_model.py --shape qwen2.5-0.5b --out models/qwen05b-q8.gguf --quantize Q8_0
  .venv/bin/python scripts/dev/make_model.py --shape qwen2.5-0.5b --true-vocab --fim --out models/coder05b.gguf

Every matrix has the named model's shape (layers, heads, grouped KV heads, MLP width, biases, tied or
separate output), drawn from a normal distribution of a trained model's scale (std 0.02, norms 1); the
vocabulary is the built-in model's (49,152 tokens, its tokenizer and chat template copied from its GGUF),
so the embedding and output matrices are that wide; --true-vocab pads it with special tokens to the named
model's own size (151,936 for Qwen2.5), so the output projection and the sampler see the real width. The
file is written F16 (or F32 with --dtype); with
--quantize, llama.cpp's `llama-quantize` (--llama-quantize PATH) turns it into any of its presets, or,
without it, gguf's own quantizers write one type for every matrix (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    arch: str  # GGUF architecture name
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool
    rope_theta: float
    eps: float
    context: int
    vocab: int  # the model's own vocabulary (--true-vocab pads the built-in one to it)


SHAPES = {  # from each model's config.json
    "smollm2-135m": Shape("llama", 576, 1536, 30, 9, 3, 64, True, False, 1e5, 1e-5, 8192, 49152),
    "qwen2.5-0.5b": Shape("qwen2", 896, 4864, 24, 14, 2, 64, True, True, 1e6, 1e-6, 32768, 151936),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 8960, 28, 12, 2, 128, True, True, 1e6, 1e-6, 32768, 151936),
    "llama-3.2-1b": Shape("llama", 2048, 8192, 16, 32, 8, 64, True, False, 5e5, 1e-5, 131072, 128256),
    "llama-3.1-8b": Shape("llama", 4096, 14336, 32, 32, 8, 128, False, False, 5e5, 1e-5, 131072, 128256),
}
CONTROL_TOKEN = 3  # GGUF's token type for a special token
OWN_QUANTIZERS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
FILE_TYPES = {
    "F32": 0,
    "F16": 1,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q8_0": 7,
    "Q5_0": 8,
    "Q5_1": 9,
}  # llama.cpp's general.file_type


FIM_NAMES = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
FIM_KEYS = ("pre", "mid", "suf", "pad", "rep", "sep")  # tokenizer.ggml.fim_<key>_token_id, in FIM_NAMES' order


def builtin_tokenizer_fields(pad_to: int | None = None, fim: bool = False):
    """(key, value, value type, array element type) of every tokenizer field of the built-in model's GGUF;
    with pad_to, its vocabulary grown to that many tokens by special ones (`<|extra_N|>`) no text encodes to;
    with fim, the first of them are Qwen2.5-Coder's fill-in-the-middle markers, named in the metadata too."""
    import gguf
    from gguf import GGUFReader

    from minibatch.engine.store.cache import BUILTIN_MODELS, builtin_gguf_path

    reader = GGUFReader(builtin_gguf_path(BUILTIN_MODELS["smollm2-135m-instruct"]))
    out = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            out.append((key, field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None))
    if pad_to is not None:
        have = next(len(v) for k, v, _, _ in out if k == "tokenizer.ggml.tokens")
        extra = range(max(0, pad_to - have))
        names = [f"<|extra_{i}|>" for i in extra]
        if fim:
            if len(names) < len(FIM_NAMES):
                raise SystemExit("make_model: --fim needs a vocabulary padded past the built-in one (--true-vocab)")
            names[: len(FIM_NAMES)] = FIM_NAMES
            out += [
                (f"tokenizer.ggml.fim_{key}_token_id", have + i, gguf.GGUFValueType.UINT32, None)
                for i, key in enumerate(FIM_KEYS)
            ]
        grown = {
            "tokenizer.ggml.tokens": lambda v: [*v, *names],
            "tokenizer.ggml.token_type": lambda v: [*v, *(CONTROL_TOKEN for _ in extra)],
            "tokenizer.ggml.scores": lambda v: [*v, *(0.0 for _ in extra)],
        }
        out = [(k, grown[k](v) if k in grown else v, t, sub) for k, v, t, sub in out]
    return out


def tensors(shape: Shape, vocab: int, rng: np.random.Generator, dtype):
    """(GGUF name, array in GGUF's row-major [out, in] layout) of every tensor, one at a time."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim

    def mat(rows: int, cols: int):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(dtype)

    def ones(n: int):
        return np.ones(n, dtype=np.float32)

    yield "token_embd.weight", mat(vocab, h)
    for i in range(shape.layers):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", ones(h)
        yield p + "attn_q.weight", mat(q, h)
        yield p + "attn_k.weight", mat(kv, h)
        yield p + "attn_v.weight", mat(kv, h)
        if shape.qkv_bias:
            for name, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                yield p + f"{name}.bias", (rng.standard_normal(n, dtype=np.float32) * 0.02)
        yield p + "attn_output.weight", mat(h, q)
        yield p + "ffn_norm.weight", ones(h)
        yield p + "ffn_gate.weight", mat(shape.intermediate, h)
        yield p + "ffn_up.weight", mat(shape.intermediate, h)
        yield p + "ffn_down.weight", mat(h, shape.intermediate)
    yield "output_norm.weight", ones(h)
    if not shape.tied:
        yield "output.weight", mat(vocab, h)


def write_gguf(
    name: str,
    shape: Shape,
    out: Path,
    dtype: str,
    quant: str | None,
    seed: int,
    true_vocab: bool = False,
    fim: bool = False,
) -> None:
    import gguf

    fields = builtin_tokenizer_fields(shape.vocab if true_vocab else None, fim)
    vocab = next(len(v) for k, v, _, _ in fields if k == "tokenizer.ggml.tokens")
    w = gguf.GGUFWriter(str(out), shape.arch)
    w.add_name(f"random {name}")
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.eps)
    w.add_vocab_size(vocab)
    w.add_file_type(FILE_TYPES[quant or dtype])
    for key, value, vtype, sub in fields:
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, vtype, sub_type=sub)
        else:
            w.add_key_value(key, value, vtype)
    np_dtype = np.float16 if dtype == "F16" else np.float32
    rng = np.random.default_rng(seed)
    qtype = getattr(gguf.GGMLQuantizationType, quant) if quant else None
    for tname, arr in tensors(shape, vocab, rng, np_dtype):
        if qtype is not None and arr.ndim == 2:
            raw = gguf.quants.quantize(arr.astype(np.float32), qtype)
            w.add_tensor(tname, raw, raw_shape=raw.shape, raw_dtype=qtype)
        else:
            w.add_tensor(tname, arr.astype(np.float32) if arr.ndim == 1 else arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()


def write_lora(out: Path, shape_name: str, rank: int, seed: int, b_scale: float = 0.01) -> Path:
    """A random LoRA adapter of `rank` on every projection of `shape_name`'s model, in llama.cpp's LoRA GGUF
    layout (f32; A at a trained adapter's scale, B's values of std `b_scale`; alpha 2 * rank), for the benchmarks
    and the tests."""
    import gguf

    shape = SHAPES[shape_name]
    q, kv, h, i = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.hidden, shape.intermediate
    sizes = {
        "attn_q": (h, q),
        "attn_k": (h, kv),
        "attn_v": (h, kv),
        "attn_output": (q, h),
        "ffn_gate": (h, i),
        "ffn_up": (h, i),
        "ffn_down": (i, h),
    }
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), shape.arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(2 * rank))
    for layer in range(shape.layers):
        for name, (n_in, n_out) in sizes.items():
            a = rng.normal(0, n_in**-0.5, (rank, n_in)).astype(np.float32)
            b = rng.normal(0, b_scale, (n_out, rank)).astype(np.float32)
            writer.add_tensor(f"blk.{layer}.{name}.weight.lora_a", a)
            writer.add_tensor(f"blk.{layer}.{name}.weight.lora_b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtype", choices=["F16", "F32"], default="F16", help="the unquantized file's type")
    ap.add_argument(
        "--quantize",
        default=None,
        help="a llama-quantize preset (Q4_K_M, Q5_0, IQ4_XS...) with --llama-quantize, else one of "
        + ", ".join(OWN_QUANTIZERS),
    )
    ap.add_argument("--llama-quantize", default=None, help="llama.cpp's llama-quantize binary")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--layers", type=int, default=None, help="fewer layers than the model has (each still its true shape)"
    )
    ap.add_argument(
        "--true-vocab",
        action="store_true",
        help="the model's own vocabulary size (151,936 for Qwen2.5), the built-in one padded with special tokens",
    )
    ap.add_argument(
        "--fim",
        action="store_true",
        help="with --true-vocab: the first padding tokens are Qwen2.5-Coder's fill-in-the-middle markers "
        "(<|fim_prefix|>...), named in the GGUF's metadata too: a coder-shaped model for /infill",
    )
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    if args.layers is not None:
        shape = replace(shape, layers=args.layers)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if args.quantize and not args.llama_quantize:
        if args.quantize not in OWN_QUANTIZERS:
            raise SystemExit(
                f"make_model: --quantize {args.quantize} needs --llama-quantize; without it: "
                + ", ".join(OWN_QUANTIZERS)
            )
        write_gguf(args.shape, shape, args.out, args.dtype, args.quantize, args.seed, args.true_vocab, args.fim)
    elif args.quantize:
        base = args.out.with_name(args.out.stem + f".{args.dtype.lower()}.gguf")
        write_gguf(args.shape, shape, base, args.dtype, None, args.seed, args.true_vocab, args.fim)
        subprocess.run(
            [args.llama_quantize, str(base), str(args.out), args.quantize, str(args.threads)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        base.unlink()
    else:
        write_gguf(args.shape, shape, args.out, args.dtype, None, args.seed, args.true_vocab, args.fim)
    print(f"make_model: {args.out} ({args.out.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

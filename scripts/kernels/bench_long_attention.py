"""Attention at long contexts on the CPU, per KV cache type: decode bytes per second against a plain copy, and
the attention part of a prefill.

  .venv/bin/python scripts/kernels/bench_long_attention.py [--shape qwen2.5-0.5b] [--contexts 8192,16384,32768]

Decode: one sequence's decode step through every layer's attention (the C++ kernel via the CPU backend: store
the new token, attend over the context), each layer its own cache as in the model, so the step streams the
whole cache from memory as a real one does. Bytes per second is the cache bytes the step reads (K and V of
every layer, in the type) over its time; the copy row is torch's copy of a buffer that size (bytes read per
second), the machine's streaming bandwidth on these threads. Prefill: one layer's attention for a whole
prompt of that length (the query tokens' part only: no matmuls), seconds, times the layer count.
Median of --repeats; every type in the same run. --split MODEL: a real prefill of one prompt of each --prefill
length (random tokens, in the engine's chunks) on that model per type, its total time and the part inside the
attention backend's forward.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from minibatch.engine.attention.metadata import AttentionMetadata  # noqa: E402
from minibatch.engine.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from minibatch.kernels.cpu.paged_attention import load_extension, store_and_attention  # noqa: E402
from minibatch.kernels.kv_types import KV_CACHE_TYPES, PagedKV, row_width, storage_dtype, to_cache_ref  # noqa: E402

# layers, query heads, KV heads, head_dim
SHAPES = {
    "qwen2.5-0.5b": (24, 14, 2, 64),
    "llama-3.2-1b": (16, 32, 8, 64),
    "llama-3.1-8b": (32, 32, 8, 128),
    "smollm2-135m": (30, 9, 3, 64),
}


def random_cache(blocks: int, block_size: int, kv_heads: int, head_dim: int, kv_type: str, g) -> torch.Tensor:
    values = torch.randn(blocks, block_size, kv_heads, head_dim, generator=g)
    out = torch.empty(blocks, block_size, kv_heads, row_width(kv_type, head_dim), dtype=storage_dtype(kv_type))
    for i in range(0, blocks, 256):  # in slices: the fp32 copy of a long context's cache would be large
        out[i : i + 256] = to_cache_ref(values[i : i + 256], kv_type)
    return out


def decode_step(shape, ctx: int, kv_type: str, block_size: int, repeats: int) -> tuple[float, int]:
    """(seconds per step through every layer, cache bytes read per step)."""
    layers, heads, kv_heads, head_dim = shape
    g = torch.Generator().manual_seed(ctx)
    per_seq = -(-ctx // block_size)
    caches = [
        PagedKV(*(random_cache(per_seq + 1, block_size, kv_heads, head_dim, kv_type, g) for _ in range(2)))
        for _ in range(layers)
    ]
    table = list(range(1, per_seq + 1))
    slot = torch.tensor([table[(ctx - 1) // block_size] * block_size + (ctx - 1) % block_size])
    meta = AttentionMetadata([1], [ctx], block_size, slot, [table])
    backend = TorchAttentionBackend(store_and_attention)
    backend.prepare(meta)
    q, k, v = torch.randn(1, heads, head_dim), torch.randn(1, kv_heads, head_dim), torch.randn(1, kv_heads, head_dim)
    times = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        for cache in caches:
            backend.forward(q, k, v, cache, meta, head_dim**-0.5)
        times.append(time.perf_counter() - t0)
    read = layers * 2 * ctx * kv_heads * caches[0].k[0, 0, 0].numel() * caches[0].k.element_size()
    return statistics.median(times[2:]), read


def copy_rate(nbytes: int, repeats: int) -> float:
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    times = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[2:])


def prefill_attention(shape, ctx: int, kv_type: str, block_size: int, repeats: int) -> float:
    """Seconds of one layer's attention for a whole prompt of ctx tokens (store and attend)."""
    _, heads, kv_heads, head_dim = shape
    per_seq = -(-ctx // block_size)
    cache = PagedKV(
        *(
            torch.zeros(per_seq + 1, block_size, kv_heads, row_width(kv_type, head_dim), dtype=storage_dtype(kv_type))
            for _ in range(2)
        )
    )
    table = list(range(1, per_seq + 1))
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)])
    meta = AttentionMetadata([ctx], [ctx], block_size, slots, [table])
    backend = TorchAttentionBackend(store_and_attention)
    backend.prepare(meta)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(ctx, heads, head_dim, generator=g)
    k, v = torch.randn(ctx, kv_heads, head_dim, generator=g), torch.randn(ctx, kv_heads, head_dim, generator=g)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        backend.forward(q, k, v, cache, meta, head_dim**-0.5)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def prefill_split(model: str, n: int, kv_type: str) -> tuple[float, float]:
    """(seconds of a real prefill of n random tokens, seconds of it inside the attention backend)."""
    import random

    from minibatch.engine.core.sampling_params import SamplingParams
    from minibatch.engine.factory import EngineConfig, build_engine

    spent = [0.0]
    forward = TorchAttentionBackend.forward

    def timed(self, *args, **kw):
        t0 = time.perf_counter()
        try:
            return forward(self, *args, **kw)
        finally:
            spent[0] += time.perf_counter() - t0

    TorchAttentionBackend.forward = timed
    try:
        eng = build_engine(
            EngineConfig(model=model, kv_cache_type=kv_type, kv_cache_tokens=n + 64, max_model_len=n + 64,
                         speculative="off", enable_prefix_caching=False, max_num_seqs=1)
        )  # fmt: skip
        rng = random.Random(n)
        for name, length in (("warm-up", 64), ("prompt", n)):
            spent[0] = 0.0
            eng.add_request(name, [rng.randrange(100, 30000) for _ in range(length)], SamplingParams(max_tokens=1))
            t0 = time.perf_counter()
            while eng.has_work():
                eng.step()
            total = time.perf_counter() - t0
        return total, spent[0]
    finally:
        TorchAttentionBackend.forward = forward


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=SHAPES, default="qwen2.5-0.5b")
    ap.add_argument("--types", default=",".join(KV_CACHE_TYPES))
    ap.add_argument("--contexts", default="8192,16384,32768", help="decode contexts, comma-separated")
    ap.add_argument("--prefill", default="1024,8192", help="prefill lengths, comma-separated ('' for none)")
    ap.add_argument("--split", metavar="MODEL", help="also time real prefills on MODEL: total and attention part")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if load_extension() is None:
        print("the C++ extension cannot be built here", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    types = args.types.split(",")
    print(f"{args.shape} ({shape[0]} layers, {shape[1]}/{shape[2]} heads of {shape[3]}), {args.threads} threads")
    print("\nDecode step, every layer's attention: ms (GB/s of cache read; copy: GB/s read by a plain copy)\n")
    print("| context | " + " | ".join(types) + " | copy |\n|---:|" + "---:|" * (len(types) + 1))
    with torch.inference_mode():
        for ctx in (int(c) for c in args.contexts.split(",")):
            cells, biggest = [], 0
            for kv_type in types:
                seconds, read = decode_step(shape, ctx, kv_type, args.block_size, args.repeats)
                cells.append(f"{seconds * 1e3:.2f} ({read / seconds / 1e9:.1f})")
                biggest = max(biggest, read)
            cells.append(f"{copy_rate(biggest, args.repeats) / 1e9:.1f}")
            print(f"| {ctx} | " + " | ".join(cells) + " |", flush=True)
        if args.prefill:
            print(f"\nPrefill attention (store and attend, no matmuls): s for all {shape[0]} layers\n")
            print("| prompt | " + " | ".join(types) + " |\n|---:|" + "---:|" * len(types))
            for ctx in (int(c) for c in args.prefill.split(",")):
                cells = [
                    f"{prefill_attention(shape, ctx, t, args.block_size, max(1, args.repeats // 3)) * shape[0]:.2f}"
                    for t in types
                ]
                print(f"| {ctx} | " + " | ".join(cells) + " |", flush=True)
        if args.split and args.prefill:
            print(f"\nA real prefill on {args.split}: s in all, s in attention (share)\n")
            print("| prompt | " + " | ".join(types) + " |\n|---:|" + "---:|" * len(types))
            for n in (int(c) for c in args.prefill.split(",")):
                cells = []
                for t in types:
                    total, attention = prefill_split(args.split, n, t)
                    cells.append(f"{total:.3f} / {attention:.3f} ({100 * attention / total:.0f}%)")
                print(f"| {n} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One layer's decode attention on the CPU: the PyTorch path (gather, then attend) against the C++ kernel.

  .venv/bin/python scripts/kernels/bench_decode_attention.py [--shape gemma2-2b] [--softcap 50] [--window 0]

Each row times the backend's forward for a batch of decode tokens over contexts of the given length
(median of --repeats calls after warm-up), both paths in the same run, with the model family's
attention shape: Gemma 2's soft-capped scores are where the C++ kernel used to be skipped.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from minibatch.engine.attention.metadata import AttentionMetadata
from minibatch.engine.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from minibatch.kernels.cpu.paged_attention import load_extension, store_and_attention  # noqa: E402

# query heads, KV heads, head_dim
SHAPES = {"gemma2-2b": (8, 4, 256), "smollm2-135m": (9, 3, 64), "mistral-7b": (32, 8, 128)}


def time_forward(
    backend,
    batch: int,
    ctx: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    softcap: float | None,
    window: int,
    repeats: int,
) -> float:
    per_seq = -(-ctx // block_size)
    cache = torch.randn(2, batch * per_seq + 1, block_size, kv_heads, head_dim)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(batch)]
    slots = torch.tensor([t[(ctx - 1) // block_size] * block_size + (ctx - 1) % block_size for t in tables])
    q, k, v = (
        torch.randn(batch, heads, head_dim),
        torch.randn(batch, kv_heads, head_dim),
        torch.randn(batch, kv_heads, head_dim),
    )
    meta = AttentionMetadata([1] * batch, [ctx] * batch, block_size, slots, tables, window=window, softcap=softcap)
    backend.prepare(meta)
    times = []
    for _ in range(repeats + 3):
        t0 = time.perf_counter()
        backend.forward(q, k, v, cache, meta, head_dim**-0.5)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:]) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=SHAPES, default="gemma2-2b")
    ap.add_argument("--softcap", type=float, default=50.0, help="0: none")
    ap.add_argument("--window", type=int, default=0)
    ap.add_argument("--cases", default="1x512,8x512,8x2048", help="batch x context, comma-separated")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if load_extension() is None:
        print("the C++ extension cannot be built here", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    heads, kv_heads, head_dim = SHAPES[args.shape]
    softcap = args.softcap or None
    backends = {
        "pytorch": TorchAttentionBackend(),
        "c++ kernel": TorchAttentionBackend(store_and_attention),
    }
    print(
        f"{args.shape} ({heads}/{kv_heads} heads, head_dim {head_dim}), softcap {softcap}, window {args.window}, "
        f"{args.threads} threads; ms per layer call, median of {args.repeats}"
    )
    print("| batch x context | PyTorch path | C++ kernel | ratio |\n| --- | --- | --- | --- |")
    with torch.inference_mode():
        for case in args.cases.split(","):
            batch, ctx = (int(x) for x in case.split("x"))
            ms = {
                name: time_forward(
                    b, batch, ctx, heads, kv_heads, head_dim, args.block_size, softcap, args.window, args.repeats
                )
                for name, b in backends.items()
            }
            print(
                f"| {batch} x {ctx} | {ms['pytorch']:.2f} | {ms['c++ kernel']:.2f} | "
                f"{ms['pytorch'] / ms['c++ kernel']:.1f}x |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One quantized matrix multiply on the CPU: the integer path against the exact one, per type and row count.

  .venv/bin/python scripts/kernels/bench_quant_matmul.py [--shape llama-3.2-1b] [--types Q4_K,Q6_K] [--rows 1,16,64,512]

For each weight type, a random matrix of the shape's MLP up projection (out x in), multiplied by random
fp32 rows: the exact path (each block dequantised for fp32 activations; torch's fp32 GEMM on dequantised
tiles past its register path's rows) against the integer path (activations quantized to 8 bits per block,
integer dot products; the quantization of the rows is included). Median of --repeats, ms per call, the
weight bytes read per ms and the ratio; the last column says which wins.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from minibatch.engine.weights.quant_linear import QuantLinear  # noqa: E402
from minibatch.kernels.cpu.quant import quant_linear  # noqa: E402
from minibatch.kernels.quant_types import INT_DOT_TYPES, QUANT_TYPES  # noqa: E402
from tests.kernels.quant_blocks import random_blocks  # noqa: E402  (random blocks with model-sized scales)

SHAPES = {  # (hidden, intermediate) of the MLP's up projection
    "smollm2-135m": (576, 1536),
    "qwen2.5-0.5b": (896, 4864),
    "llama-3.2-1b": (2048, 8192),
    "qwen2.5-1.5b": (1536, 8960),
}


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    ap.add_argument("--types", default="Q4_0,Q4_1,Q5_0,Q8_0,Q4_K,Q5_K,Q6_K")
    ap.add_argument("--rows", default="1,16,64,512")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    k, n = SHAPES[args.shape]
    print(
        f"{args.shape}: [{n} x {k}] weights, {torch.get_num_threads()} threads, ms per call (median of {args.repeats})"
    )
    print("| type | rows | exact ms | integer ms | integer GB/s | exact / integer | faster |")
    print("|---|---:|---:|---:|---:|---:|---|")
    with torch.inference_mode():
        for name in args.types.split(","):
            qtype = QUANT_TYPES[name]
            if name not in INT_DOT_TYPES or k % qtype.block_elems:
                print(f"| {name} | - | - | - | - | - | no integer path for this shape |")
                continue
            blocks = random_blocks(qtype, n, k, seed=1)
            layer = QuantLinear(
                blocks, qtype, k, int8=True
            )  # as the engine holds it (packed where the kernel reads so)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k)
                exact = timed(lambda x=x, b=blocks, t=qtype: quant_linear(x, b, t), args.repeats)
                fast = timed(lambda x=x, f=layer: f(x), args.repeats)
                print(
                    f"| {name} | {rows} | {exact * 1e3:.2f} | {fast * 1e3:.2f} | {blocks.numel() / fast / 1e9:.1f} | "
                    f"{exact / fast:.2f} | {'integer' if fast < exact else 'exact'} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())

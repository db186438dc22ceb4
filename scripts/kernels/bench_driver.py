"""Measure the model store and the minimal greedy driver on this machine.

Reports: conversion time (from the cache's record), load time of the converted
model, peak RSS, and greedy decode tokens/s at several batch sizes (median of
--repeats runs). Run: .venv/bin/python scripts/kernels/bench_driver.py
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch

from minibatch.engine.attention.torch_backend import TorchAttentionBackend
from minibatch.engine.store.cache import SOURCE_FILE, resolve_model
from minibatch.engine.testing.greedy import greedy_generate
from minibatch.engine.weights.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    path = resolve_model(args.model)
    source = path / SOURCE_FILE
    conversion = json.loads(source.read_text())["seconds"] if source.exists() else None
    started = time.perf_counter()
    model = load_model(path, TorchAttentionBackend())
    load_s = time.perf_counter() - started
    print(f"model dir: {path}")
    print(f"conversion (recorded when it ran): {conversion:.1f} s" if conversion else "conversion: n/a")
    print(f"load of converted model: {load_s:.2f} s   torch threads: {torch.get_num_threads()}")

    g = torch.Generator().manual_seed(0)
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [torch.randint(100, 40000, (args.prompt_len,), generator=g).tolist() for _ in range(batch)]
        greedy_generate(model, prompts, 4)  # warm-up
        rates = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            greedy_generate(model, prompts, 1)
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            greedy_generate(model, prompts, args.new_tokens)
            total = time.perf_counter() - t0
            # decode rate: tokens after the first, over the time after prefill
            rates.append(batch * (args.new_tokens - 1) / max(total - prefill, 1e-9))
        print(f"batch {batch:>3}: greedy decode {statistics.median(rates):8.1f} tok/s (median of {args.repeats})")
    print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()

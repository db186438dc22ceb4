"""GPU check (run by `make gpu-check` on a machine with an NVIDIA GPU).

1. Greedy parity on the GPU: bf16 (the GPU default) against the fp32 reference on
   a fixed prompt set; the first 32 tokens must match, else it reports where and
   the top-2 logit margin at the divergence (a near-tie means precision, not a bug).
2. Decode tokens/s at batch 1, 16 and 64 (bf16, Triton kernels, CUDA graphs).
3. The paged-attention kernel's achieved memory bandwidth on a decode batch, as a
   fraction of this GPU's measured device-to-device copy bandwidth.
"""

from __future__ import annotations

import sys
import time

import torch

from minibatch.engine.factory import EngineConfig, build_engine
from minibatch.engine.sampling_params import SamplingParams

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain recursion briefly.",
           "List three prime numbers and explain why they are prime."]


def greedy(engine, prompts, n):
    reqs = [engine.add_request(f"p{i}-{time.monotonic_ns()}", engine.tokenizer.chat([{"role": "user", "content": p}]),
                               SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)) for i, p in enumerate(prompts)]
    while engine.has_work():
        engine.step()
    return [r.output_token_ids for r in reqs]


def decode_rate(engine, batch: int, steps: int = 128) -> float:
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", list(range(100, 164)), SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    decode_tokens, decode_time = 0, 0.0
    while engine.has_work():
        torch.cuda.synchronize()
        t = time.perf_counter()
        _, st = engine.step()
        torch.cuda.synchronize()
        if st is not None and st.prefill_tokens == 0:
            decode_tokens += st.decode_tokens
            decode_time += time.perf_counter() - t
    return decode_tokens / decode_time


def attention_bandwidth() -> tuple[float, float]:
    from minibatch.kernels.paged_attention import paged_attention

    seqs, ctx, heads, kv_heads, dim, bs = 64, 2048, 32, 8, 128, 16
    blocks = seqs * ctx // bs + 1
    cache = torch.randn(2, blocks, bs, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    tables = (torch.randperm(blocks - 1, device="cuda")[: seqs * ctx // bs] + 1).view(seqs, -1).int()
    q = torch.randn(seqs, heads, dim, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(seqs + 1, device="cuda", dtype=torch.int32)
    lens = torch.full((seqs,), ctx, device="cuda", dtype=torch.int32)
    for _ in range(3):
        paged_attention(q, cache, tables, qsl, lens, dim**-0.5, 1)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        paged_attention(q, cache, tables, qsl, lens, dim**-0.5, 1)
    torch.cuda.synchronize()
    kernel_bw = 20 * 2 * seqs * ctx * kv_heads * dim * 2 / (time.perf_counter() - t)
    a = torch.empty(2**30 // 2, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    copy_bw = 10 * 2 * a.numel() * 2 / (time.perf_counter() - t)
    return kernel_bw, copy_bw


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA GPU here", file=sys.stderr)
        return 2
    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    ok = True
    ref_engine = build_engine(EngineConfig(device="cuda", dtype="float32", max_num_seqs=8, kv_cache_gb=2))
    ref = greedy(ref_engine, PROMPTS, 32)
    del ref_engine
    engine = build_engine(EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=64, kv_cache_gb=8))
    got = greedy(engine, PROMPTS, 32)
    for i, (r, g) in enumerate(zip(ref, got)):
        same = r == g
        first = next((j for j, (a, b) in enumerate(zip(r, g)) if a != b), None)
        print(f"parity prompt {i}: {'match' if same else f'diverges at token {first}'}")
        ok &= same
    for batch in (1, 16, 64):
        print(f"decode batch {batch:>2}: {decode_rate(engine, batch):9.1f} tok/s")
    kernel_bw, copy_bw = attention_bandwidth()
    print(f"paged attention: {kernel_bw / 1e9:.0f} GB/s = {kernel_bw / copy_bw:.2f} of the measured copy bandwidth ({copy_bw / 1e9:.0f} GB/s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Perplexity of a model over a text, computed as llama.cpp's `llama-perplexity` computes it, per weight path
and KV cache type.

  .venv/bin/python scripts/kernels/perplexity.py                       # built-in model, native and native-exact
  .venv/bin/python scripts/kernels/perplexity.py --model file.gguf --weights native,native-exact,float32 --chunks 32
  .venv/bin/python scripts/kernels/perplexity.py --weights native --kv-cache-type f32,f16,q8_0  # as -ctk/-ctv

The text (default: scripts/data/hamlet.txt, public domain) is tokenized whole, as llama-perplexity does
(a BOS first only when the model's tokenizer adds one), and cut into chunks of --ctx tokens; each chunk
runs alone from an empty cache, and the negative log-likelihood of every token in its second half is
scored (the first half is context). Perplexity = exp(mean NLL), with its standard error. Every weight
path runs with every KV cache type (each chunk's K and V stored in that type, then attended from it, as the
engine serves) on the same chunks in one process, and each is compared with the first pair: the mean KL
divergence of its next-token distribution from the first's, and how often both pick the same top token.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from minibatch.engine.attention.metadata import build_flat_batch
from minibatch.engine.attention.select import select_backend
from minibatch.engine.runner.kv_cache import allocate_kv_cache
from minibatch.engine.store.cache import resolve_model
from minibatch.engine.text.tokenizer import TextTokenizer
from minibatch.engine.weights.loader import load_model
from minibatch.kernels.kv_types import KVCacheTypes

TEXT = Path(__file__).resolve().parents[1] / "data" / "hamlet.txt"


@torch.inference_mode()
def chunk_logprobs(model, tokens: list[int], types: KVCacheTypes, block_size: int = 16) -> torch.Tensor:
    """[len(tokens) // 2 - 1, vocab] log-probabilities of the next token at every scored position of one chunk."""
    n = len(tokens)
    caches = allocate_kv_cache(model.config, -(-n // block_size), block_size, types, "cpu")
    batch = build_flat_batch([tokens], [0], [list(range(-(-n // block_size)))], block_size, "cpu")
    hidden = model(batch.input_ids, batch.positions, caches, batch.attn)
    first = n // 2
    return torch.log_softmax(model.compute_logits(hidden[first : n - 1]).double(), dim=-1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument(
        "--weights",
        default="native,native-exact",
        help="weight paths, comma-separated; the first is the reference for KL",
    )
    ap.add_argument(
        "--kv-cache-type", default="f32", help="KV cache types, comma-separated (each TYPE or K_TYPE/V_TYPE)"
    )
    ap.add_argument("--text", type=Path, default=TEXT)
    ap.add_argument("--ctx", type=int, default=512, help="tokens per chunk")
    ap.add_argument("--chunks", type=int, default=16, help="chunks scored (at most what the text holds)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    tok = TextTokenizer(model_dir)
    ids = tok.encode_prompt(args.text.read_text())  # the tokenizer's BOS, if it adds one
    chunks = min(args.chunks, len(ids) // args.ctx)
    if chunks < 1:
        raise SystemExit(f"perplexity: the text has {len(ids)} tokens, fewer than one chunk of {args.ctx}")
    weights = args.weights.split(",")
    models = {w: load_model(model_dir, select_backend("cpu", torch.float32)[0], weights=w) for w in weights}
    kv_types = {t: KVCacheTypes.parse(t.replace("/", ",")) for t in args.kv_cache_type.split(",")}
    paths = [f"{w} {t}" for w in weights for t in kv_types]  # every pair; the first is the reference
    print(
        f"{args.model}: {len(ids)} tokens, {chunks} chunks of {args.ctx}, "
        f"{(args.ctx // 2 - 1) * chunks} scored tokens; "
        f"{torch.get_num_threads()} threads",
        file=sys.stderr,
    )
    nll = {w: [] for w in paths}
    kl = {w: [] for w in paths[1:]}
    same = {w: 0 for w in paths[1:]}
    seconds = {w: 0.0 for w in paths}
    for c in range(chunks):
        tokens = ids[c * args.ctx : (c + 1) * args.ctx]
        targets = torch.tensor(tokens[args.ctx // 2 + 1 :])
        ref = None
        for w in paths:
            started = time.perf_counter()
            weight, kv = w.split(" ")
            lp = chunk_logprobs(models[weight], tokens, kv_types[kv])
            seconds[w] += time.perf_counter() - started
            nll[w].extend((-lp.gather(1, targets[:, None])[:, 0]).tolist())
            if ref is None:
                ref = lp
            else:
                kl[w].extend((ref.exp() * (ref - lp)).sum(-1).tolist())
                same[w] += int((ref.argmax(-1) == lp.argmax(-1)).sum())
        print(
            f"[{c + 1}] " + " ".join(f"{w} {math.exp(sum(v) / len(v)):.4f}" for w, v in nll.items()),
            file=sys.stderr,
            flush=True,
        )
    print("| weights, KV cache | perplexity | ± | KL vs " + paths[0] + " | same top token | s per chunk |")
    print("|---|---:|---:|---:|---:|---:|")
    for w in paths:
        values = nll[w]
        mean = sum(values) / len(values)
        sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        ppl = math.exp(mean)
        err = ppl * sd / math.sqrt(len(values))  # delta method, as llama-perplexity reports it
        kl_text = f"{sum(kl[w]) / len(kl[w]):.6f}" if w in kl else "-"
        same_text = f"{100 * same[w] / len(values):.2f}%" if w in same else "-"
        print(f"| {w} | {ppl:.4f} | {err:.4f} | {kl_text} | {same_text} | {seconds[w] / chunks:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

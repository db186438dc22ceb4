#!/usr/bin/env python3
"""GPU check: `make gpu-check` on a machine with an NVIDIA GPU, as that machine is.

It uses the python3, torch and triton it finds and installs nothing: `minibatch`
is imported from this working tree, and pure-Python packages the machine lacks
(platformdirs, gguf, pydantic) are unpacked from the wheel folder that
`scripts/dev/gpu_wheels.sh` prepares elsewhere. The model is SmolLM2-135M's
architecture with seeded random weights, built from its config and tokenizer
files (`make gpu-prepare` puts them in build/gpu; otherwise the built-in
model's cache), so nothing large travels.

What it checks, in one run (under 8 minutes on an H200, Triton compiles included):

1. The Triton kernel tests compiled (fp32, fp16, bf16 against the PyTorch
   twins), the CUDA-graph tests and the sampler's tests, on the device.
2. Greedy parity, fp32 on the GPU against transformers on the same weights:
   prompt logits and 32 greedy tokens per prompt.
3. bf16 against fp32: agreement length per prompt and, at the first
   divergence, the fp32 logit margin between the two choices. It fails only
   when that margin is larger than bf16 could explain: above both the bf16
   spacing of that logit and twice the largest bf16-vs-fp32 difference
   measured on the prompt's own logits; and when the prompt logits' cosine
   similarity falls below 0.999.
4. CUDA-graph decode against eager decode (fp32): equal tokens.
5. Decode tokens/s at batch 1, 16, 64 and 256 (bf16), with and without graphs,
   and with graphs sampled at the chat's defaults.
6. The sampler alone (ms per step) on trained-shaped and flat rows of 49,152
   and 151,936 tokens, beside argmax.
7. Paged decode attention's achieved bandwidth as a fraction of a device copy
   measured in the same run, by context length (1k-32k), batch (1-256) and KV
   type (bf16, q8_0, q4_0).
8. transformers' own continuous batching (`generate_batch`) on the same model
   and trace, as the GPU peer.
9. A GGUF of a real architecture on the device: Qwen2.5-0.5B's widths and its
   151,936-token vocabulary (fewer layers), in a Q4_K_M-like mix of block types,
   dequantised on the GPU at load: fp32 against transformers on gguf.quants'
   values, bf16 against fp32, and its decode tokens/s greedy and sampled.

It prints one summary and writes a JSON report (--report). `--smoke-cpu` runs
the same pipeline on the CPU with a tiny model (no kernels, no graphs), to
prove the script itself before GPU time is spent on it.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "kernels", "daemon", "tui")
MODEL_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
)
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion briefly.",
    "List three prime numbers and explain why they are prime.",
]
GPU_TESTS = [
    "tests/kernels/test_triton_kernels.py",
    "tests/kernels/test_paged_decode.py",
    "tests/kernels/test_triton_sampling.py",
    "tests/kernels/test_gguf_dequant.py",
    "tests/engine/test_cuda_graphs.py",
    "tests/kernels/test_sampling.py",
]
# Qwen2.5-0.5B's widths and vocabulary (fewer layers: the GGUF is written on the device, the check is of the
# architecture, the block types and the 151,936-token rows, not of depth)
QWEN_SHAPE = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "use_sliding_window": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
}
# llama-quantize's Q4_K_M as it mixes types: Q4_K, with V and the MLP's down projection in Q6_K (the
# embedding, tied to the output, in Q8_0); at 896-wide rows its fallbacks (Q5_0 for Q4_K, Q8_0 for Q6_K), as
# in Qwen2.5-0.5B's own Q4_K_M file
GGUF_MIX = ("Q4_K", {"v_proj": "Q6_K", "down_proj": "Q6_K", "embed_tokens": "Q8_0"})


# -- running on a bare machine ------------------------------------------------

NEEDED = ("platformdirs", "gguf", "pydantic")  # imported by minibatch, absent from a bare GPU machine's stack


def bootstrap(work: Path, wheels: Path | None, needed: tuple[str, ...] = NEEDED) -> list[str]:
    """Make `minibatch` and the missing pure-Python packages importable; returns the sys.path entries added."""
    added = []
    if importlib.util.find_spec("minibatch") is None or importlib.util.find_spec("minibatch.engine") is None:
        pkg = work / "pkgroot" / "minibatch"
        pkg.mkdir(parents=True, exist_ok=True)
        for name in PACKAGES:
            link = pkg / name
            if not link.exists():
                link.symlink_to(ROOT / name)
        added.append(str(pkg.parent))
        sys.path.insert(0, str(pkg.parent))
        importlib.invalidate_caches()
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        if wheels is None or not any(wheels.glob("*.whl")):
            raise SystemExit(
                f"gpu-check: {', '.join(missing)} cannot be imported and there is no wheel folder at {wheels}: "
                "run scripts/dev/gpu_wheels.sh (or make gpu-prepare) on a machine with a package registry and bring "
                "its folder along"
            )
        site = work / "site"
        site.mkdir(parents=True, exist_ok=True)
        for whl in sorted(wheels.glob("*.whl")):
            with zipfile.ZipFile(whl) as z:
                tops = {n.split("/")[0] for n in z.namelist() if not n.split("/")[0].endswith((".dist-info", ".data"))}
                modules = {t[:-3] if t.endswith(".py") else t for t in tops}
                if any(importlib.util.find_spec(m) is None for m in modules if m.isidentifier()):
                    z.extractall(site)
        sys.path.append(str(site))
        added.append(str(site))
        importlib.invalidate_caches()
        still = [m for m in missing if importlib.util.find_spec(m) is None]
        if still:
            raise SystemExit(
                f"gpu-check: the wheel folder {wheels} does not provide {', '.join(still)} for Python "
                f"{platform.python_version()}"
            )
    return added


def gpu_state() -> tuple[str, str | None]:
    """('ok', None), ('none', why) without an NVIDIA GPU, ('unusable', why) when torch cannot use the one there is."""
    import torch

    from minibatch.kernels.gpu.triton_support import cuda_device_unusable

    if torch.cuda.is_available():
        return "ok", None
    why = cuda_device_unusable()
    if why:
        return "unusable", why
    return "none", "this machine has no NVIDIA GPU; the check needs an NVIDIA GPU and a CUDA build of torch"


def environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}")
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            env["driver"] = out.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    return env


# -- the model ----------------------------------------------------------------


def model_files(prepared: Path) -> Path:
    """SmolLM2-135M's config and tokenizer: from `make gpu-prepare`'s folder, else the built-in model's cache."""
    here = prepared / "smollm2-135m"
    if (here / "config.json").exists() and (here / "tokenizer.json").exists():
        return here
    from minibatch.engine.store.cache import resolve_model

    return resolve_model("smollm2-135m-instruct")


def prepare(prepared: Path) -> Path:
    """Copy the built-in model's config and tokenizer files (a few MB) where the GPU run finds them."""
    from minibatch.engine.store.cache import resolve_model

    src = resolve_model("smollm2-135m-instruct")
    dst = prepared / "smollm2-135m"
    dst.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)
    return dst


def random_model(files: Path, out: Path, device: str, seed: int = 0, tiny: bool = False) -> Path:
    """The architecture in `files` with seeded random weights (transformers' own init), saved as safetensors."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(files)
    if tiny:  # --smoke-cpu: the same tokenizer, a model small enough for the CPU
        cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size = 2, 64, 128
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 4, 2, 16
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    for name in MODEL_FILES:
        if name != "config.json" and (files / name).exists():
            shutil.copy2(files / name, out / name)
    del model
    return out


# -- measurements -------------------------------------------------------------


def build(
    model_dir: Path, device: str, dtype: str, max_num_seqs: int, graphs: bool, kv_gb: float, speculative: str = "off"
):
    from minibatch.engine.factory import EngineConfig, build_engine

    return build_engine(
        EngineConfig(
            model=str(model_dir),
            device=device,
            dtype=dtype,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(512, max_num_seqs),
            kv_cache_gb=kv_gb,
            cuda_graphs=graphs,
            enable_prefix_caching=False,
            weights="float32",
            speculative=speculative,
        )
    )


def release() -> None:
    """Hand the memory of what the caller just dropped back to the device."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def prompt_ids(engine) -> list[list[int]]:
    return [engine.tokenizer.chat([{"role": "user", "content": p}]) for p in PROMPTS]


def greedy(engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    from minibatch.engine.core.sampling_params import SamplingParams

    reqs = [
        engine.add_request(
            f"g{i}-{time.monotonic_ns()}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        )
        for i, p in enumerate(prompts)
    ]
    while engine.has_work():
        engine.step()
    return [list(r.output_token_ids) for r in reqs]


def engine_logits(engine, ids: list[int]):
    """Our model's logits at the last position of `ids` (written into the idle pool's first blocks)."""
    import torch

    from minibatch.engine.attention.metadata import build_flat_batch

    runner = engine.runner
    table = list(range(1, -(-len(ids) // runner.block_size) + 1))
    batch = build_flat_batch([ids], [0], [table], runner.block_size, runner.device)
    with torch.inference_mode():
        hidden = runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.attn)
        return runner.model.compute_logits(hidden[batch.logits_indices]).float()[0]


def hf_logits(hf, ids: list[int]):
    import torch

    with torch.inference_mode():
        return hf(torch.tensor([ids], device=hf.device)).logits[0, -1].float()


def hf_greedy(hf, prompts: list[list[int]], n: int) -> list[list[int]]:
    import torch

    out = []
    hf.generation_config.eos_token_id = None  # exactly n tokens, like ignore_eos (no EOS masking either)
    hf.generation_config.pad_token_id = 0
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=hf.device)
            gen = hf.generate(ids, max_new_tokens=n, do_sample=False)
            out.append(gen[0, len(p) :].tolist())
    return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)


def bf16_spacing(x: float) -> float:
    """The distance between adjacent bf16 numbers around |x| (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


def compare_greedy(name: str, ref: list[list[int]], got: list[list[int]], prompts, logits_fn) -> list[dict]:
    """Per prompt: tokens that agree, and at the first divergence the reference's logit margin.

    The margin is between the two choices, the reference's and ours.
    """
    rows = []
    for i, (r, g) in enumerate(zip(ref, got)):
        j = first_divergence(r, g)
        row = {"prompt": i, "agree": len(r) if j is None else j, "of": len(r)}
        if j is not None:
            logits = logits_fn(prompts[i] + r[:j])
            row.update(
                ref_token=r[j],
                got_token=g[j],
                margin=float(logits[r[j]] - logits[g[j]]),
                spacing=bf16_spacing(float(logits[r[j]])),
                logit=float(logits[r[j]]),
            )
        rows.append(row)
    return rows


def fp32_against(hf, fp32, name: str, tokens: int) -> tuple[list[list[int]], list[list[int]], dict]:
    """An fp32 engine against transformers' model `hf` on the same prompts: the prompts, our greedy tokens, and
    the logits' largest difference with the greedy rows. fp32 against fp32 may part only at a near-tie of the
    reference (the summation order differs)."""
    prompts = prompt_ids(fp32)
    diffs = [float((engine_logits(fp32, p) - hf_logits(hf, p)).abs().max()) for p in prompts]
    ours = greedy(fp32, prompts, tokens)
    rows = compare_greedy(name, hf_greedy(hf, prompts, tokens), ours, prompts, lambda ids: hf_logits(hf, ids))
    ok = max(diffs) < 1e-3 and all(r["agree"] == r["of"] or abs(r["margin"]) < 1e-3 for r in rows)
    return prompts, ours, {"max_abs_logit_diff": max(diffs), "greedy": rows, "ok": ok}


def decode_rate(engine, batch: int, steps: int, sync, sampling: dict | None = None) -> float:
    """Decode tokens/s at `batch` rows: greedy, or sampled with `sampling` (the chat's defaults)."""
    from minibatch.engine.core.sampling_params import SamplingParams

    for i in range(batch):
        engine.add_request(
            f"b{batch}-{i}-{time.monotonic_ns()}",
            list(range(100, 164)),
            SamplingParams(**(sampling or {"temperature": 0}), seed=i, max_tokens=steps, ignore_eos=True),
        )
    tokens, seconds = 0, 0.0
    while engine.has_work():
        sync()
        t = time.perf_counter()
        _, st = engine.step()
        sync()
        if st is not None and st.prefill_tokens == 0:
            tokens += st.decode_tokens
            seconds += time.perf_counter() - t
    return tokens / seconds if seconds else 0.0


def chat_sampling() -> dict:
    """The chat's pane defaults (its own PaneSettings), as the benchmarks' `--sampling chat` takes them."""
    from minibatch.tui.history import PaneSettings

    return PaneSettings().request_params()


def sampler_cost(device: str, sync, repeats: int = 30, vocabs=(49152, 151936), sizes=(1, 64, 256)) -> list[dict]:
    """The GPU sampler alone (TritonOps.sample_tokens, the tokens back on the host as the engine takes them)
    beside argmax, ms per step: rows shaped as a trained model's (a few logits far above a long tail: the
    candidates decide them in two passes) and flat rows (random weights' logits: the candidates cannot, the
    row's values are searched), at the chat's defaults, 49,152 and 151,936 tokens; how the rows were decided
    (kernels/gpu/sampling.py's PATHS)."""
    import torch

    from minibatch.engine.models.ops import TritonOps
    from minibatch.kernels.gpu.sampling import PATHS, sample_rows

    chat = chat_sampling()
    setting = (chat["temperature"], chat.get("top_p", 1.0), chat.get("min_p", 0.0), float(chat.get("top_k", -1)))
    g = torch.Generator().manual_seed(5)
    out = []

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(repeats):
            sync()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return round(statistics.median(times) * 1e3, 3)

    for vocab in vocabs:
        for rows in sizes:
            for kind in ("trained-shaped", "flat"):
                x = torch.randn(rows, vocab, generator=g) * 3
                if kind == "trained-shaped":
                    x[:, :: vocab // 50] += 12
                x = x.to(device)
                settings = torch.tensor([setting] * rows, dtype=torch.float64)
                streams = torch.stack([torch.arange(rows), torch.full((rows,), 7)], dim=1)
                ms = timed(lambda x=x, s=settings, u=streams: TritonOps.sample_tokens(x, s, u, None).tolist())
                greedy_ms = timed(lambda x=x: TritonOps.argmax_rows(x).tolist())
                paths = sample_rows(x, settings, streams, None)[1][:, 2].tolist()
                decided = {PATHS[p]: paths.count(p) for p in sorted(set(paths))}
                out.append(
                    {"vocab": vocab, "rows": rows, "logits": kind, "sampled_ms": ms, "argmax_ms": greedy_ms}
                    | {"decided": decided}
                )
                print(
                    f"    {vocab:>6} tokens x {rows:>3} rows, {kind:>14}: {ms:7.3f} ms sampled, "
                    f"{greedy_ms:7.3f} ms argmax",
                    flush=True,
                )
    return out


def trace(n: int, prompt_len: int, vocab: int, seed: int = 1) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (n, prompt_len), generator=g).tolist()


def run_trace_ours(engine, prompts, new_tokens: int, sync) -> dict:
    from minibatch.engine.core.sampling_params import SamplingParams

    sync()
    t = time.perf_counter()
    reqs = [
        engine.add_request(
            f"t{i}-{time.monotonic_ns()}", p, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        )
        for i, p in enumerate(prompts)
    ]
    while engine.has_work():
        engine.step()
    sync()
    wall = time.perf_counter() - t
    tokens = sum(len(r.output_token_ids) for r in reqs)
    return {"tokens": tokens, "seconds": round(wall, 3), "tok_s": round(tokens / wall, 1)}


def run_trace_hf(hf, prompts, new_tokens: int, sync, smoke: bool = False) -> dict:
    """transformers' generate_batch on the trace, after one warm-up call. The smoke run, which times nothing,
    skips that call and the manager's own warm-up and gives it a cache for the trace alone (left to itself on
    a CPU, it sizes its cache and batch from the memory it finds and warms up at those sizes: 15 s here)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gc = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    extra: dict = {}
    if smoke:
        page = 256
        blocks = len(prompts) * -(-(max(len(p) for p in prompts) + new_tokens) // page) + 1
        extra = dict(
            warmup=False,
            continuous_batching_config=ContinuousBatchingConfig(
                page_size=page, num_blocks=blocks, max_batch_tokens=1024, max_requests_per_batch=len(prompts)
            ),
        )
    else:
        hf.generate_batch(inputs=prompts[:4], generation_config=gc, progress_bar=False)
    sync()
    t = time.perf_counter()
    out = hf.generate_batch(inputs=prompts, generation_config=gc, progress_bar=False, **extra)
    sync()
    wall = time.perf_counter() - t
    tokens = sum(len(o.generated_tokens) for o in out.values())
    return {"tokens": tokens, "seconds": round(wall, 3), "tok_s": round(tokens / wall, 1)}


def gguf_model(files: Path, out: Path, device: str, tiny: bool) -> Path:
    """A random Qwen2 model (QWEN_SHAPE; --smoke-cpu: narrower) written as a GGUF in GGUF_MIX's block types,
    and the model folder that stands for it (the K-quants' blocks are random with a trained model's scales:
    gguf.quants cannot quantize to them). Returns that folder."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    sys.path.insert(0, str(ROOT))  # the tests' GGUF writer (tests/engine/gguf_models.py)
    from tests.engine.gguf_models import write_gguf_model

    shape = dict(QWEN_SHAPE)
    if tiny:
        shape.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
        shape["num_hidden_layers"] = 2
    hf_dir = out / "qwen2-hf"
    torch.manual_seed(1)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**shape), dtype=torch.float32)
    model.save_pretrained(hf_dir)
    del model
    for name in MODEL_FILES:
        if name != "config.json" and (files / name).exists():
            shutil.copy2(files / name, hf_dir / name)
    qtype, mix = GGUF_MIX
    write_gguf_model(hf_dir, out / "qwen2-gguf", qtype, arch="qwen2", mix=mix)
    return out / "qwen2-gguf" / f"dir-{qtype}-mixed"


def timed_cuda(fn, repeats: int) -> float:
    """Seconds per call, after warming up (the device's queue drained before and after)."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - t) / repeats


def random_cache(kv_type: str, blocks: int, bs: int, kv_heads: int, dim: int, device: str = "cuda"):
    """A paged K and V cache of random rows: normal values, or a block type's random quants under 0.01 scales
    (and minimums, where the type has them)."""
    import torch

    from minibatch.kernels.kv_types import BLOCK_BYTES, PagedKV, is_block_type, row_width, storage_dtype

    if not is_block_type(kv_type):
        dt = storage_dtype(kv_type)
        return PagedKV(*(torch.randn(blocks, bs, kv_heads, dim, device=device, dtype=dt) for _ in "kv"))
    rows = []
    halves = 2 if kv_type in ("q4_1", "q5_1") else 1
    for _ in "kv":
        c = torch.randint(0, 256, (blocks, bs, kv_heads, row_width(kv_type, dim)), dtype=torch.uint8, device=device)
        scales = c.view(blocks, bs, kv_heads, -1, BLOCK_BYTES[kv_type])[..., : 2 * halves]
        scales.copy_(torch.tensor([0.01] * halves, dtype=torch.float16).view(torch.uint8).to(device))
        rows.append(c.view(storage_dtype(kv_type)))
    return PagedKV(*rows)


def attention_bandwidth(
    contexts=(1024, 8192, 32768),
    batches=(1, 16, 64, 256),
    kv_types=("bf16", "q8_0", "q4_0"),
    budget_gb: float = 24.0,
    device: str = "cuda",
    shape: tuple[int, int, int] = (32, 8, 128),
    repeats: int = 10,
) -> dict:
    """Decode attention (one query per sequence; `shape`: Llama-8B's 32 query heads on 8 KV heads of 128) over
    the paged cache: the K and V bytes it must read per call over its time, against a device copy. One cache
    per KV type, as large as the largest run needs (within budget_gb), the smaller runs reading part of it."""
    import torch

    from minibatch.kernels.gpu.paged_attention import paged_attention
    from minibatch.kernels.kv_types import row_bytes

    (heads, kv_heads, dim), bs = shape, 16
    runs = []
    for kv_type in kv_types:
        fits = [
            (b, c)
            for b in batches
            for c in contexts
            if b * c * kv_heads * row_bytes(kv_type, dim) * 2 <= budget_gb * 1e9
        ]
        need = max(b * -(-c // bs) for b, c in fits)  # blocks the largest run reads
        blocks = need + 1
        cache = random_cache(kv_type, blocks, bs, kv_heads, dim, device)
        perm = torch.randperm(blocks - 1, device=device) + 1
        for ctx in contexts:
            for seqs in batches:
                if (seqs, ctx) not in fits:
                    continue
                tables = perm[: seqs * -(-ctx // bs)].view(seqs, -1).int()
                q = torch.randn(
                    seqs, heads, dim, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32
                )
                qsl = torch.arange(seqs + 1, device=device, dtype=torch.int32)
                lens = torch.full((seqs,), ctx, device=device, dtype=torch.int32)
                attend = functools.partial(paged_attention, q, cache, tables, qsl, lens, dim**-0.5, 1, max_seq_len=ctx)
                sec = timed_cuda(attend, repeats)
                read = 2 * seqs * ctx * kv_heads * row_bytes(kv_type, dim)
                runs.append(
                    {
                        "kv_type": kv_type,
                        "context": ctx,
                        "batch": seqs,
                        "us": round(sec * 1e6, 1),
                        "gb_s": round(read / sec / 1e9, 1),
                    }
                )
        cache = None
        release()
    a = torch.empty(2**29 if device == "cuda" else 2**22, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    copy = 2 * a.numel() * 2 / timed_cuda(lambda: b.copy_(a), repeats)
    for r in runs:
        r["fraction"] = round(r["gb_s"] * 1e9 / copy, 3)
        print(
            f"    {r['kv_type']:>5} {r['context']:>6} keys x {r['batch']:>3}: {r['gb_s']:7.1f} GB/s "
            f"= {r['fraction']:.2f} of a copy",
            flush=True,
        )
    return {"copy_gb_s": round(copy / 1e9, 1), "shape": f"{heads} heads on {kv_heads} KV heads of {dim}", "runs": runs}


def run_pytest(paths: list[str], pythonpath: list[str], timeout: float) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(pythonpath + [os.environ.get("PYTHONPATH", "")]).strip(os.pathsep),
    }
    t = time.monotonic()
    try:
        p = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        return {
            "ok": False,
            "summary": f"timed out after {timeout:.0f} s",
            "tail": (exc.stdout or "")[-3000:] if isinstance(exc.stdout, str) else "",
        }
    lines = [line for line in p.stdout.splitlines() if line.strip()]
    summary = lines[-1] if lines else p.stderr.strip()[-300:]
    return {
        "ok": p.returncode == 0,
        "summary": summary,
        "seconds": round(time.monotonic() - t, 1),
        "tail": "" if p.returncode == 0 else (p.stdout + p.stderr)[-4000:],
    }


# -- the run ------------------------------------------------------------------


def check(args) -> tuple[dict, bool]:
    import torch

    smoke = args.smoke_cpu
    device = "cpu" if smoke else "cuda"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    report: dict = {"environment": environment(), "mode": "smoke-cpu" if smoke else "gpu"}
    ok = True
    started = time.monotonic()

    def step(name: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {name}", flush=True)

    if not smoke:
        step("kernel and CUDA-graph tests on the device")
        report["pytest"] = run_pytest(GPU_TESTS, args.pythonpath, timeout=300)
        ok &= report["pytest"]["ok"]
    else:
        report["pytest"] = {"ok": True, "summary": "skipped in --smoke-cpu (make test runs them in the interpreter)"}

    step("random-weight model")
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        files = model_files(args.prepared)
        model_dir = random_model(files, work / "model", device, tiny=smoke)
        report["model"] = {
            "architecture": "SmolLM2-135M" if not smoke else "SmolLM2 tokenizer, tiny 2-layer model",
            "weights": "random, seed 0 (transformers' init)",
            "files_from": str(files),
        }

        step("fp32 on the device against transformers")
        from minibatch.engine.weights.reference import load_hf_reference

        hf = load_hf_reference(model_dir, torch.float32).to(device)
        fp32 = build(model_dir, device, "float32", 8, graphs=True, kv_gb=1)
        prompts, ours, report["fp32_parity"] = fp32_against(hf, fp32, "fp32", args.tokens)
        ok &= report["fp32_parity"]["ok"]

        step("CUDA-graph decode against eager decode (fp32)")
        eager = build(model_dir, device, "float32", 8, graphs=False, kv_gb=1)
        eager_tokens = greedy(eager, prompts, args.tokens)
        graphs_used = getattr(fp32.runner, "graphs", None) is not None
        same = eager_tokens == ours
        report["graphs_vs_eager"] = {
            "graphs_captured": graphs_used,
            "equal": same,
            "greedy": compare_greedy("graphs", eager_tokens, ours, prompts, lambda ids: engine_logits(eager, ids)),
        }
        ok &= same and (graphs_used or smoke)
        eager = None
        release()

        step("speculative decoding on and off (fp32, greedy, repeating prompts)")
        spec = build(model_dir, device, "float32", 8, graphs=True, kv_gb=1, speculative="ngram")
        repeating = [(p * 3)[-200:] for p in prompts]  # a prompt repeated: drafts worth verifying
        rates_spec = {}
        for name, eng in (("off", fp32), ("ngram", spec)):
            greedy(eng, repeating[:1], 8)  # warm-up
            sync()
            t0 = time.perf_counter()
            tokens_spec = greedy(eng, repeating[:1], args.tokens)
            sync()
            rates_spec[name] = (tokens_spec, round(len(tokens_spec[0]) / (time.perf_counter() - t0), 1))
        batch_off, batch_on = greedy(fp32, repeating, args.tokens), greedy(spec, repeating, args.tokens)
        spec_rows = compare_greedy("speculative", batch_off, batch_on, repeating, lambda ids: engine_logits(fp32, ids))
        spec_ok = rates_spec["off"][0] == rates_spec["ngram"][0] and all(
            r["agree"] == r["of"] or abs(r["margin"]) < 1e-3 for r in spec_rows
        )
        report["speculative"] = {
            "greedy": spec_rows,
            "batch1_tok_s_off": rates_spec["off"][1],
            "batch1_tok_s_ngram": rates_spec["ngram"][1],
            "draft_tokens": spec.spec.drafted,
            "accepted_tokens": spec.spec.accepted,
            "ok": spec_ok,
        }
        ok &= spec_ok
        spec = None
        release()

        step("bf16 against fp32")
        bf16 = build(
            model_dir, device, "bfloat16", 256 if not smoke else 16, graphs=True, kv_gb=8 if not smoke else 0.2
        )
        sims, errs = [], []
        for p in prompts:
            a, b = engine_logits(fp32, p), engine_logits(bf16, p)
            sims.append(float(torch.nn.functional.cosine_similarity(a, b, dim=0)))
            errs.append(float((a - b).abs().max()))
        got = greedy(bf16, prompts, args.tokens)
        rows = compare_greedy("bf16", ours, got, prompts, lambda ids: engine_logits(fp32, ids))
        bad = [r for r in rows if r["agree"] < r["of"] and r["margin"] > max(r["spacing"], 2 * errs[r["prompt"]])]
        bf16_ok = not bad and min(sims) >= 0.999
        report["bf16_vs_fp32"] = {
            "greedy": rows,
            "prompt_logit_cosine": sims,
            "prompt_logit_max_abs_diff": errs,
            "unexplained_divergences": bad,
            "ok": bf16_ok,
        }
        ok &= bf16_ok
        fp32 = hf = None
        release()

        step("decode tokens/s")
        sizes = (1, 16, 64, 256) if not smoke else (1, 16)
        steps = args.decode_steps
        no_graphs = build(model_dir, device, "bfloat16", max(sizes), graphs=False, kv_gb=8 if not smoke else 0.2)
        rates = {}
        chat = chat_sampling()
        for b in sizes:
            rates[b] = {
                "graphs": round(decode_rate(bf16, b, steps, sync), 1),
                "eager": round(decode_rate(no_graphs, b, steps, sync), 1),
                "graphs_chat_sampled": round(decode_rate(bf16, b, steps, sync, chat), 1),
            }
            print(
                f"    batch {b:>3}: {rates[b]['graphs']:9.1f} tok/s with graphs, {rates[b]['eager']:9.1f} without; "
                f"{rates[b]['graphs_chat_sampled']:9.1f} sampled at the chat's defaults (graphs)",
                flush=True,
            )
        report["chat_sampling"] = chat
        report["decode_tok_s"] = rates
        no_graphs = None
        release()

        # The measurements below depend on nothing before them: one that fails is reported, and the rest run
        # (device time is lent by the minute).
        step("the sampler alone, at the chat's defaults")
        if smoke:  # the pipeline, not the numbers: one vocabulary, two sizes
            sampler = functools.partial(sampler_cost, device, sync, repeats=1, vocabs=(49152,), sizes=(1, 2))
        else:
            sampler = functools.partial(sampler_cost, device, sync)
        ok &= guarded(report, "sampler_ms", sampler)

        step("paged decode attention bandwidth")
        if smoke:  # the code, not the numbers: the interpreter, f32 and q8_0 caches, one context past a split
            bandwidth = functools.partial(
                attention_bandwidth, (600,), (1, 2), ("f32", "q8_0"), 0.1, device, shape=(4, 2, 64), repeats=1
            )
        else:
            bandwidth = attention_bandwidth
        ok &= guarded(report, "attention_bandwidth", bandwidth)

        step("the same trace: minibatch against transformers' generate_batch")
        n = 256 if not smoke else 8
        prompts_t = trace(n, 64, bf16.info.vocab_size)
        peer: dict = {"requests": n, "prompt_tokens": 64, "new_tokens": args.trace_tokens}
        peer["minibatch"] = run_trace_ours(bf16, prompts_t, args.trace_tokens, sync)
        bf16 = None
        release()
        try:
            hf16 = load_hf_reference(model_dir, torch.bfloat16).to(device)
            peer["transformers_generate_batch"] = run_trace_hf(hf16, prompts_t, args.trace_tokens, sync, smoke=smoke)
            peer["ratio"] = round(peer["minibatch"]["tok_s"] / peer["transformers_generate_batch"]["tok_s"], 2)
            hf16 = None
            release()
        except Exception as exc:  # noqa: BLE001 - the peer failing is reported, not ours to fail on
            peer["transformers_generate_batch"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        report["peer"] = peer

        step("a GGUF of a real architecture, dequantised on the device")
        ok &= guarded(report, "gguf", functools.partial(gguf_check, files, work, device, sync, args, smoke))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["seconds"] = round(time.monotonic() - started, 1)
    report["ok"] = bool(ok)
    return report, bool(ok)


def guarded(report: dict, key: str, measure) -> bool:
    """report[key] = measure() (a result, or (result, ok)); a failure is written there instead
    ({"error": ...}) and the check goes on. Returns whether it passed."""
    import traceback

    try:
        out = measure()
    except Exception as exc:  # noqa: BLE001 - reported, and the other measurements still run
        report[key] = {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-4000:]}
        print(f"    FAILED: {type(exc).__name__}: {exc}"[:500], flush=True)
        release()
        return False
    if isinstance(out, tuple):
        report[key], passed = out
        return bool(passed)
    report[key] = out
    return True


def gguf_check(files: Path, work: Path, device: str, sync, args, smoke: bool) -> tuple[dict, bool]:
    """GGUF_MIX's file of a Qwen2 model on the device: fp32 against transformers holding gguf.quants' values
    (the exact path: equal greedy tokens), bf16 against fp32 (divergences only where bf16 explains them), the
    load time, and decode tokens/s greedy and at the chat's defaults with CUDA graphs."""
    import torch

    from minibatch.engine.weights.reference import load_hf_reference

    t = time.perf_counter()
    model_dir = gguf_model(files, work, device, tiny=smoke)
    written = round(time.perf_counter() - t, 1)
    hf = load_hf_reference(model_dir, torch.float32).to(device)
    t = time.perf_counter()
    fp32 = build(model_dir, device, "float32", 8, graphs=True, kv_gb=1)
    loaded = round(time.perf_counter() - t, 1)
    prompts, ours, parity = fp32_against(hf, fp32, "gguf fp32", args.tokens)
    hf = None
    release()
    bf16 = build(model_dir, device, "bfloat16", 64 if not smoke else 16, graphs=True, kv_gb=4 if not smoke else 0.2)
    errs = [float((engine_logits(fp32, p) - engine_logits(bf16, p)).abs().max()) for p in prompts]
    got = greedy(bf16, prompts, args.tokens)
    rows16 = compare_greedy("gguf bf16", ours, got, prompts, lambda ids: engine_logits(fp32, ids))
    bad = [r for r in rows16 if r["agree"] < r["of"] and r["margin"] > max(r["spacing"], 2 * errs[r["prompt"]])]
    fp32 = None
    release()
    rates = {}
    chat = chat_sampling()
    for b in (1, 16, 64) if not smoke else (1, 16):
        rates[b] = {
            "graphs": round(decode_rate(bf16, b, args.decode_steps, sync), 1),
            "graphs_chat_sampled": round(decode_rate(bf16, b, args.decode_steps, sync, chat), 1),
        }
    bf16 = None
    release()
    out = {
        "architecture": "qwen2" + (" (tiny widths)" if smoke else ", Qwen2.5-0.5B's widths, 4 layers"),
        "vocab": QWEN_SHAPE["vocab_size"],
        "types": {"matrices": GGUF_MIX[0], **GGUF_MIX[1]},
        "write_s": written,
        "load_s": loaded,
        "fp32_vs_transformers": parity,
        "bf16_vs_fp32": {"greedy": rows16, "max_abs_logit_diff": errs, "unexplained_divergences": bad},
        "decode_tok_s": rates,
    }
    return out, parity["ok"] and not bad


def summary(report: dict) -> str:
    env = report["environment"]
    lines = [
        f"gpu-check ({report['mode']}): {'PASS' if report['ok'] else 'FAIL'} in {report['seconds']:.0f} s",
        f"  {env.get('gpu', 'CPU')} · driver {env.get('driver')} · python {env['python']} · torch {env['torch']} "
        f"(CUDA {env['cuda']}) · triton {env['triton']} · transformers {env['transformers']}",
        f"  tests: {report['pytest']['summary']}",
    ]
    p = report["fp32_parity"]
    agree = ", ".join(f"{r['agree']}/{r['of']}" for r in p["greedy"])
    lines.append(f"  fp32 vs transformers: max |logit diff| {p['max_abs_logit_diff']:.2e}; greedy agreement {agree}")
    g = report["graphs_vs_eager"]
    lines.append(
        f"  CUDA graphs vs eager (fp32): {'equal' if g['equal'] else 'DIFFERENT'} (captured: {g['graphs_captured']})"
    )
    sp = report["speculative"]
    agree_spec = ", ".join(f"{r['agree']}/{r['of']}" for r in sp["greedy"])
    lines.append(
        f"  speculative (ngram, fp32): greedy agreement {agree_spec}; {sp['accepted_tokens']}/{sp['draft_tokens']} "
        f"drafts accepted; batch 1 {sp['batch1_tok_s_ngram']:.1f} tok/s against {sp['batch1_tok_s_off']:.1f} off"
    )
    b = report["bf16_vs_fp32"]
    parts = []
    for r in b["greedy"]:
        parts.append(
            f"{r['agree']}/{r['of']}"
            + (f" (margin {r['margin']:.3g}, spacing {r['spacing']:.3g})" if r["agree"] < r["of"] else "")
        )
    lines.append(f"  bf16 vs fp32: {'; '.join(parts)}; prompt logits cosine >= {min(b['prompt_logit_cosine']):.5f}")
    for size, r in report["decode_tok_s"].items():
        lines.append(
            f"  decode batch {size:>3}: {r['graphs']:9.1f} tok/s with graphs, {r['eager']:9.1f} without; "
            f"sampled {r['graphs_chat_sampled']:9.1f} ({r['graphs_chat_sampled'] / r['graphs']:.2f}x greedy)"
        )
    for key in ("sampler_ms", "attention_bandwidth", "gguf"):
        if isinstance(report.get(key), dict) and "error" in report[key]:
            lines.append(f"  {key}: FAILED, {report[key]['error'][:300]}")
    for r in report.get("sampler_ms", []) if isinstance(report.get("sampler_ms"), list) else []:
        lines.append(
            f"  sampler {r['vocab']:>6} x {r['rows']:>3} rows, {r['logits']:>14}: {r['sampled_ms']:.3f} ms "
            f"(argmax {r['argmax_ms']:.3f} ms); decided by {r['decided']}"
        )
    if "runs" in report.get("attention_bandwidth", {}):
        a = report["attention_bandwidth"]
        lines.append(f"  paged decode attention ({a['shape']}), against a device copy of {a['copy_gb_s']:.0f} GB/s:")
        for r in a["runs"]:
            lines.append(
                f"    {r['kv_type']:>5} cache, {r['context']:>6} keys x {r['batch']:>3}: {r['gb_s']:7.1f} GB/s "
                f"= {r['fraction']:.2f}"
            )
    peer = report["peer"]
    hf = peer["transformers_generate_batch"]
    theirs = f"{hf['tok_s']:.1f} tok/s" if "tok_s" in hf else hf["error"]
    lines.append(
        f"  trace {peer['requests']} x ({peer['prompt_tokens']} + {peer['new_tokens']}): minibatch "
        f"{peer['minibatch']['tok_s']:.1f} tok/s, transformers generate_batch {theirs}"
        + (f" ({peer['ratio']:.2f}x)" if "ratio" in peer else "")
    )
    if "decode_tok_s" in report.get("gguf", {}):
        g = report["gguf"]
        p = g["fp32_vs_transformers"]
        agree = ", ".join(f"{r['agree']}/{r['of']}" for r in p["greedy"])
        agree16 = ", ".join(f"{r['agree']}/{r['of']}" for r in g["bf16_vs_fp32"]["greedy"])
        lines.append(
            f"  GGUF {g['architecture']} ({g['vocab']} tokens; {g['types']}): loaded in {g['load_s']} s; fp32 vs "
            f"transformers max |logit diff| {p['max_abs_logit_diff']:.2e}, greedy {agree}; bf16 vs fp32 {agree16}"
        )
        for size, r in g["decode_tok_s"].items():
            lines.append(
                f"    decode batch {size:>3}: {r['graphs']:9.1f} tok/s greedy, {r['graphs_chat_sampled']:9.1f} sampled "
                f"({r['graphs_chat_sampled'] / r['graphs']:.2f}x)"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report", type=Path, default=ROOT / "results" / "gpu-check.json", help="JSON report path")
    ap.add_argument("--prepared", type=Path, default=ROOT / "build" / "gpu", help="folder from `make gpu-prepare`")
    ap.add_argument("--wheels", type=Path, default=None, help="wheel folder (default: PREPARED/wheels)")
    ap.add_argument(
        "--prepare", action="store_true", help="copy the model's config and tokenizer into --prepared and stop"
    )
    ap.add_argument("--smoke-cpu", action="store_true", help="run the pipeline on the CPU with a tiny model")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt for the parity checks")
    ap.add_argument("--decode-steps", type=int, default=128)
    ap.add_argument("--trace-tokens", type=int, default=128, help="new tokens per request in the peer trace")
    args = ap.parse_args(argv)
    work = args.prepared / "runtime"
    args.pythonpath = bootstrap(work, args.wheels or args.prepared / "wheels")
    if args.prepare:
        print(f"gpu-check: model files in {prepare(args.prepared)}")
        return 0
    if args.smoke_cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.tokens, args.decode_steps, args.trace_tokens = (
            min(args.tokens, 8),
            min(args.decode_steps, 8),
            min(args.trace_tokens, 8),
        )
    else:
        state, why = gpu_state()
        if state != "ok":
            print(f"gpu-check: {why}", file=sys.stderr)
            return 2 if state == "none" else 3
    report, ok = check(args)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=2))
    print(summary(report))
    print(f"report: {args.report}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

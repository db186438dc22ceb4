"""Build a ready LLMEngine from an EngineConfig: resolve and load the model, size the KV cache."""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

from minibatch.engine.core.block_manager import BlockManager
from minibatch.engine.core.config import MODES, SCHEDULER_DEFAULTS, SchedulerConfig
from minibatch.engine.core.engine import LLMEngine
from minibatch.engine.core.info import WEIGHT_MODES, EngineInfo, VisionFacts
from minibatch.engine.core.sampling_params import SAMPLING_DEFAULT_FIELDS
from minibatch.engine.encoders.config import is_encoder_dir
from minibatch.engine.heap import release_free_memory
from minibatch.engine.kv_offload.disk import DEFAULT_MIN_TOKENS
from minibatch.engine.lora.names import parse_loras
from minibatch.engine.models.config import ModelConfig, ModelSettingError
from minibatch.engine.spec_decode.config import DEFAULT_METHOD, DEFAULT_NUM_TOKENS, SpecConfig
from minibatch.engine.store.cache import DEFAULT_MODEL, resolve_model
from minibatch.engine.testing import faults
from minibatch.kernels.cpu.extension import describe as describe_cpu_kernels
from minibatch.kernels.kv_types import KVCacheTypes

DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(slots=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    mode: str = "continuous"
    max_num_seqs: int = SCHEDULER_DEFAULTS["max_num_seqs"]
    max_num_batched_tokens: int = SCHEDULER_DEFAULTS["max_num_batched_tokens"]
    max_model_len: int | None = None  # None: the model's own context length (LongRoPE: its original one)
    max_wait_ms: float = SCHEDULER_DEFAULTS["max_wait_ms"]
    max_queue: int | None = 256  # requests that may wait behind a full batch (the scheduler's cap; None: no cap)
    block_size: int = 16
    kv_cache_gb: float | None = None  # None: kv_cache_fraction of the memory available once the model is loaded
    kv_cache_fraction: float | None = None  # None: 0.1 on CPU, 0.8 on a GPU (see kv_budget)
    kv_cache_tokens: int | None = None  # a pool of this many tokens (llama.cpp's -c); overrides the byte budget
    kv_cache_type: str = "auto"  # TYPE or K_TYPE,V_TYPE of kernels/kv_types.py's; auto: see default_kv_types
    timeline_steps: int = 512  # steps the timeline ring keeps (GET /v1/engine/steps)
    cuda_graphs: bool = True  # capture decode graphs on a GPU (MINIBATCH_CUDA_GRAPHS=0 also turns them off)
    num_kv_blocks: int | None = None  # exact pool size (tests, experiments); overrides the budget
    enable_prefix_caching: bool = True
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto: fp32 on CPU, bf16 on GPU
    threads: int | None = None  # torch intra-op threads on CPU
    weights: str = "auto"  # one of WEIGHT_MODES (core/info.py)
    speculative: str = DEFAULT_METHOD  # one of spec_decode/config.py SPEC_METHODS
    num_speculative_tokens: int = DEFAULT_NUM_TOKENS  # draft tokens per row per step at most
    draft_model: str | None = None  # speculative draft: the smaller model of the same vocabulary
    # The disk tier of the prefix cache (kv_offload/): off for an engine a program builds; the daemon's option
    # turns it on (engine/options.py: DEFAULT_PROMPT_CACHE_GB)
    prompt_cache_gb: float = 0.0
    prompt_cache_dir: str | None = None  # None: kv_offload/disk.py's default_folder()
    prompt_cache_min_tokens: int = DEFAULT_MIN_TOKENS  # a shorter run on disk is recomputed (the crossover)
    cache_reuse: int = SCHEDULER_DEFAULTS["cache_reuse"]  # shifted reuse's shortest run (core/kv_reuse.py); 0: off
    cache_reuse_settle: int = SCHEDULER_DEFAULTS["cache_reuse_settle"]  # its runs' first tokens computed anyway
    lora: str | None = None  # LoRA adapters served over the model: NAME=PATH pairs, comma-separated (lora/names.py)
    max_lora_rank: int = 64  # an adapter of a larger rank is refused at its load
    max_loras: int = 8  # adapters resident at once: one more named is loaded in place of the least recently used
    lora_dir: str | None = None  # a folder of adapters served by name on demand (daemon/models/adapters.py)
    # Images (engine/vision/): the tower and projector from this mmproj GGUF or Hugging Face folder (None: the
    # model folder's own, when it has one); and what a request may send
    mmproj: str | None = None
    max_images: int = 8  # images in one request at most
    max_image_bytes: int = 20 * 2**20  # one image's encoded bytes at most
    max_image_pixels: int = 32 * 2**20  # one image's width x height at most, read from its header

    def __post_init__(self) -> None:
        parse_loras(self.lora)  # refuses a malformed pair, naming the option
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        for name in ("max_images", "max_image_bytes", "max_image_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        self.spec_config()  # refuses a method or a draft length out of range, naming it
        SchedulerConfig(  # refuses a limit out of range, naming it, before anything is loaded
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len or SCHEDULER_DEFAULTS["max_model_len"],
            max_wait_ms=self.max_wait_ms,
            max_queue=self.max_queue,
            cache_reuse=self.cache_reuse,
            cache_reuse_settle=self.cache_reuse_settle,
        )
        for name in ("kv_cache_gb", "kv_cache_fraction", "prompt_cache_gb", "max_wait_ms"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"max_queue must be 0 or more, got {self.max_queue}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {self.weights!r}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(
                f"kv_cache_tokens must be at least one block ({self.block_size}), got {self.kv_cache_tokens}"
            )
        if self.kv_cache_type != "auto":
            KVCacheTypes.parse(self.kv_cache_type)  # names the option and the types there are
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be positive, got {self.kv_cache_gb}")
        if self.timeline_steps < 1:
            raise ValueError(f"timeline_steps must be at least 1, got {self.timeline_steps}")
        if self.prompt_cache_gb < 0:
            raise ValueError(f"prompt_cache_gb must be 0 (off) or more, got {self.prompt_cache_gb}")
        if self.prompt_cache_min_tokens < self.block_size:
            raise ValueError(
                f"prompt_cache_min_tokens must be at least one block ({self.block_size}), got "
                f"{self.prompt_cache_min_tokens}"
            )
        if self.cache_reuse < 0:
            raise ValueError(f"cache_reuse must be 0 (off) or more, got {self.cache_reuse}")
        if self.kv_cache_fraction is not None and not 0 < self.kv_cache_fraction <= 0.95:
            raise ValueError(f"kv_cache_fraction must be in (0, 0.95], got {self.kv_cache_fraction}")

    def spec_config(self) -> SpecConfig:
        return SpecConfig(self.speculative, self.num_speculative_tokens, draft_model=self.draft_model)


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


DEFAULT_KV_FRACTION = {"cpu": 0.1, "cuda": 0.8}


def default_kv_types(device: str, dtype_name: str, exact_weights: bool, head_dim: int) -> KVCacheTypes:
    """--kv-cache-type auto. On the CPU: q8_0 (a quarter of fp32's bytes: the fastest decode at long contexts
    and perplexity within 0.5% of fp32's, BENCHMARKS.md "Long contexts"), f16 where the heads are not a
    multiple of 32 values, and f32 where the weights run exactly (native-exact, fp32 safetensors): those
    modes promise the reference's results. On a GPU: the model's dtype."""
    if device == "cuda":
        name = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}[dtype_name]
    elif exact_weights:
        name = "f32"
    else:
        name = "q8_0" if head_dim % 32 == 0 else "f16"
    return KVCacheTypes(name, name)


def kv_budget(config: EngineConfig, device: str) -> tuple[int, str]:
    """The KV pool's byte budget and how it was chosen. One rule on every device:

    --kv-cache-gb when given; else --kv-cache-fraction of the memory available
    once the model is loaded and its temporary copies are freed: MemAvailable
    on CPU (default 0.1: the machine runs other programs), the GPU's free
    memory (default 0.8: the rest is for activations and CUDA graphs).
    """
    if config.kv_cache_gb is not None:
        return int(config.kv_cache_gb * 2**30), f"--kv-cache-gb {config.kv_cache_gb:g}"
    fraction = config.kv_cache_fraction if config.kv_cache_fraction is not None else DEFAULT_KV_FRACTION[device]
    if device == "cuda":
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()  # the fp32 -> bf16 copies' memory is cached by the allocator, not free
        available, what = torch.cuda.mem_get_info()[0], "free GPU memory"
    else:
        available, what = available_memory_bytes(), "available memory"
    return int(available * fraction), f"{fraction:g} of {available / 2**30:.1f} GiB {what}"


def generation_config(model_dir) -> tuple[set[int], dict]:
    """(extra stop token ids, default sampling values) from the model's generation_config.json, when it has one."""
    import json
    from pathlib import Path

    path = Path(model_dir) / "generation_config.json"
    try:
        gen = json.loads(path.read_text())
    except (OSError, ValueError):
        return set(), {}
    eos = gen.get("eos_token_id")
    ids = set(eos) if isinstance(eos, list) else ({eos} if isinstance(eos, int) else set())
    defaults = {
        k: gen[k]
        for k in SAMPLING_DEFAULT_FIELDS
        if isinstance(gen.get(k), (int, float)) and not isinstance(gen.get(k), bool)
    }
    return ids, defaults


def kv_cache_types(config: EngineConfig, model_dir, device: str, dtype_name: str, exact_weights: bool) -> KVCacheTypes:
    """The types this model's cache is kept in (--kv-cache-type), refused before the load when the model or the
    device cannot hold them, naming the option and the types there are."""
    from minibatch.engine.models.config import ModelConfig
    from minibatch.engine.runner.kv_cache import types_problem
    from minibatch.kernels.kv_types import KV_CACHE_TYPES, is_block_type

    mc = ModelConfig.from_dir(model_dir)
    if config.kv_cache_type == "auto":
        return default_kv_types(device, dtype_name, exact_weights, mc.head_dim)
    types = KVCacheTypes.parse(config.kv_cache_type)
    problem = types_problem(mc, types)
    if problem:
        raise ModelSettingError(f"kv_cache_type {types}: {problem} (the types are {', '.join(KV_CACHE_TYPES)})")
    floats = [t == "f32" for t in (types.k, types.v) if not is_block_type(t)]
    if device == "cuda" and any(wide != (dtype_name == "float32") for wide in floats):
        raise ModelSettingError(
            f"kv_cache_type {types}: on the GPU an f32 cache goes with --dtype float32, 16 bits with 16"
        )
    return types


def build_engine(config: EngineConfig) -> LLMEngine:
    import torch

    from minibatch.engine.attention.select import select_backend
    from minibatch.engine.runner.kv_cache import (
        allocate_kv_cache,
        bytes_per_block,
        bytes_per_token,
        num_blocks_for_budget,
    )
    from minibatch.engine.runner.model_runner import ModelRunner
    from minibatch.engine.text.tokenizer import TextTokenizer
    from minibatch.engine.weights.facts import weight_facts
    from minibatch.engine.weights.loader import load_model, runs_exactly

    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but no CUDA GPU is available")
    dtype_name = config.dtype if config.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    if config.threads:
        torch.set_num_threads(config.threads)

    model_dir = resolve_model(config.model)
    if is_encoder_dir(model_dir):
        return build_encoder_engine(config, model_dir, device, dtype_name)
    backend, ops = select_backend(device, dtype)
    if backend.name == "triton":  # refuse what the GPU kernels cannot run before loading anything
        from minibatch.engine.attention.select import gpu_shape_problems
        from minibatch.engine.models.config import ModelConfig

        mc = ModelConfig.from_dir(model_dir)
        problems = gpu_shape_problems(mc.num_heads, mc.num_kv_heads, mc.head_dim, config.block_size)
        if problems:
            raise ValueError(f"{config.model} cannot run on the GPU kernels: {'; '.join(problems)}")
    kv_types = kv_cache_types(
        config, model_dir, device, dtype_name, runs_exactly(model_dir, config.weights, device, dtype)
    )
    model = load_model(model_dir, backend, device=device, dtype=dtype, ops=ops, weights=config.weights)
    tokenizer = TextTokenizer(model_dir)
    cfg = model.config
    max_model_len = min(config.max_model_len or cfg.default_context, cfg.max_position)

    budget_rule = "--num-kv-blocks"
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif config.kv_cache_tokens is not None:  # and the null block
        num_blocks, budget_rule = (
            -(-config.kv_cache_tokens // config.block_size) + 1,
            f"--kv-cache-tokens {config.kv_cache_tokens}",
        )
    else:
        budget, budget_rule = kv_budget(config, device)
        num_blocks = num_blocks_for_budget(cfg, config.block_size, kv_types, budget)
        # Never more than every running request at full context could use (+ the null block).
        num_blocks = min(num_blocks, config.max_num_seqs * -(-max_model_len // config.block_size) + 1)
    if num_blocks < 2:
        raise ValueError(
            f"the KV-cache budget ({budget_rule}) gives {num_blocks} block(s) of {config.block_size} tokens; at "
            "least 2 are needed: raise it"
        )
    # LongRoPE past its original length: the long factors, for every position. No sequence outgrows the
    # pool (admission refuses one that would), so the rotary tables hold at most that many positions.
    model.use_context(max_model_len, positions=(num_blocks - 1) * config.block_size)
    caches = allocate_kv_cache(cfg, num_blocks, config.block_size, kv_types, device)
    runner = ModelRunner(model, caches, config.block_size, token_texts=tokenizer.token_texts)
    if (
        device == "cuda"
        and backend.name == "triton"
        and config.cuda_graphs
        and os.environ.get("MINIBATCH_CUDA_GRAPHS", "1") != "0"
    ):
        from minibatch.engine.runner.cuda_graphs import DecodeGraphs

        runner.graphs = DecodeGraphs(model, caches, config.block_size, max_model_len, config.max_num_seqs)
        runner.graphs.capture()
    runner = faults.wrap_from_env(runner)  # the test seam: unchanged unless MINIBATCH_FAULT_AT_STEP is set
    spec = config.spec_config()
    proposer = None
    if spec.method == "draft":
        proposer = build_draft_proposer(
            spec, config, tokenizer, backend, ops, device, dtype, num_blocks, max_model_len, kv_types
        )

    tier = None
    if config.prompt_cache_gb > 0 and config.enable_prefix_caching:
        tier = build_disk_tier(config, model_dir, model, device, dtype_name, ops.name, kv_types, caches)

    gen_eos, gen_defaults = generation_config(model_dir)
    eos = set(cfg.eos_token_ids) | gen_eos  # e.g. Llama 3's end-of-turn tokens beside end-of-text
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    engine = LLMEngine(
        runner,
        tokenizer,
        BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, window=cfg.release_window),
        SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            max_wait_ms=config.max_wait_ms,
            max_queue=config.max_queue,
            vocab_size=cfg.vocab_size,
            cache_reuse=config.cache_reuse,
            cache_reuse_settle=config.cache_reuse_settle,
        ),
        eos_token_ids=tuple(sorted(eos)),
        mode=config.mode,
        timeline_steps=config.timeline_steps,
        speculative=spec,
        proposer=proposer,
        tier=tier,
    )
    if config.lora or config.lora_dir:
        from minibatch.engine.lora.adapter import load_adapter

        engine.lora_reader = functools.partial(load_adapter, cfg=cfg, max_rank=config.max_lora_rank)
        # every adapter --lora names is checked at the start; the first --max-loras stay resident
        for i, (name, path) in enumerate(parse_loras(config.lora).items()):
            adapter = engine.lora_reader(path, name)
            if i < config.max_loras:
                engine.add_lora(adapter)
    vision = attach_images(engine, config, model_dir, cfg)
    engine.info = EngineInfo(
        model=config.model,
        model_dir=str(model_dir),
        family=cfg.model_type,
        device=device,
        dtype=dtype_name,
        weights=model.weights_desc,
        attention=backend.name,
        ops=ops.name,
        cpu_kernels=describe_cpu_kernels() if device == "cpu" else None,
        block_size=config.block_size,
        num_kv_blocks=num_blocks,
        kv_budget=budget_rule,
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
        vocab_size=cfg.vocab_size,
        eos_token_ids=tuple(sorted(eos)),
        generation_defaults=gen_defaults,
        # which LongRoPE factors this run rotates with (use_context)
        rope_factors=("long" if model.model.rotary.long else "short") if cfg.rope.rope_type == "longrope" else None,
        memory=weight_facts(model),
        kv_cache_bytes=num_blocks * bytes_per_block(cfg, config.block_size, kv_types),
        kv_cache_type=str(kv_types),
        kv_bytes_per_token=bytes_per_token(cfg, kv_types),
        kv_cache_tokens=(num_blocks - 1) * config.block_size,
        embedding_size=1 if cfg.pooling == "rank" else cfg.hidden_size,
        pooling=cfg.pooling,
        tasks=("rerank",) if cfg.pooling == "rank" else ("generate", "embed"),
        loras=tuple(parse_loras(config.lora)),
        vision=vision,
        speculative="off"
        if not spec.enabled
        else f"{spec.method}{' ' + spec.draft_model if spec.draft_model else ''} (up to {spec.num_tokens} tokens)",
    )
    release_free_memory()  # the load's temporaries (file reads, stacked copies) leave the heap
    return engine


def attach_images(engine: LLMEngine, config: EngineConfig, model_dir, cfg: ModelConfig) -> VisionFacts | None:
    """The model's vision tower (--mmproj's, else its folder's own, when it has one) behind the request bounds,
    set as engine.images; its facts for EngineInfo. None for a model that sees no images."""
    from minibatch.engine.vision.images import ImageEncoder, ImageLimits, layout_of
    from minibatch.engine.vision.loader import VisionError, load_vision

    text_width, image_token_id = cfg.hidden_size, cfg.image_token_id
    if config.mmproj is None and image_token_id is None:
        return None
    source = config.mmproj or str(model_dir)
    if config.mmproj is not None and not os.path.exists(config.mmproj):
        raise ModelSettingError(f"mmproj {os.path.basename(config.mmproj)}: no such file or folder")
    try:
        vision = load_vision(source)
    except VisionError as exc:
        raise VisionError(f"mmproj {os.path.basename(source)}: {exc}" if config.mmproj else str(exc)) from None
    if vision.text_width != text_width:
        raise ModelSettingError(
            f"mmproj: its projector makes {vision.text_width}-wide embeddings; the model's are {text_width} wide"
        )
    layout = layout_of(vision, engine.tokenizer.vocab(), image_token_id, cfg.image_bounds)
    if layout.whole and layout.tokens > config.max_num_batched_tokens:  # (a chunk may cut a causal image's run)
        raise ModelSettingError(
            f"max_num_batched_tokens {config.max_num_batched_tokens}: an image takes {layout.tokens} positions, "
            "computed in one step; raise it"
        )
    limits = ImageLimits(config.max_images, config.max_image_bytes, config.max_image_pixels)
    engine.images = ImageEncoder(vision, layout, limits)
    return VisionFacts(
        family=vision.family,
        source="mmproj " + os.path.basename(source) if config.mmproj else "the model folder",
        image_size=vision.processor.size,
        tokens_per_image=layout.tokens,
        max_image_positions=layout.positions(vision.processor.largest),
        max_images=limits.max_images,
        max_image_bytes=limits.max_image_bytes,
        max_image_pixels=limits.max_image_pixels,
    )


def build_encoder_engine(config: EngineConfig, model_dir, device: str, dtype_name: str) -> LLMEngine:
    """An encoder's engine (BERT, XLM-RoBERTa: embeddings, or a cross-encoder's rerank scores): the same
    scheduler and step, with no KV cache (an input attends within itself, computed whole in one step: the
    token budget is raised to the longest input) and so no prefix cache, no speculation, no disk tier. Its
    block pool still counts each input's tokens, holding no tensors."""
    import torch

    from minibatch.engine.encoders.loader import load_encoder
    from minibatch.engine.models.ops import TorchOps
    from minibatch.engine.runner.model_runner import ModelRunner
    from minibatch.engine.text.tokenizer import TextTokenizer
    from minibatch.engine.weights.facts import weight_facts

    model = load_encoder(model_dir, device=device, dtype=getattr(torch, dtype_name), ops=TorchOps())
    cfg = model.config
    tokenizer = TextTokenizer(model_dir)
    max_model_len = min(config.max_model_len or cfg.max_position, cfg.max_position)
    budget = max(config.max_num_batched_tokens, max_model_len)
    num_blocks = config.max_num_seqs * -(-max_model_len // config.block_size) + 1
    runner = faults.wrap_from_env(ModelRunner(model, [], config.block_size))
    engine = LLMEngine(
        runner,
        tokenizer,
        BlockManager(num_blocks, config.block_size, enable_prefix_caching=False),
        SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            max_wait_ms=config.max_wait_ms,
            max_queue=config.max_queue,
            vocab_size=cfg.vocab_size,
            cache_reuse=0,
            whole_prompts=True,
        ),
        eos_token_ids=(),
        mode=config.mode,
        timeline_steps=config.timeline_steps,
    )
    engine.info = EngineInfo(
        model=config.model,
        model_dir=str(model_dir),
        family=cfg.model_type,
        device=device,
        dtype=dtype_name,
        weights=model.weights_desc,
        attention="bidirectional",
        ops="torch",
        cpu_kernels=None,
        block_size=config.block_size,
        num_kv_blocks=num_blocks,
        kv_budget="none (an encoder keeps no KV cache)",
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
        vocab_size=cfg.vocab_size,
        eos_token_ids=(),
        memory=weight_facts(model),
        kv_cache_type="none",
        kv_cache_tokens=(num_blocks - 1) * config.block_size,
        embedding_size=cfg.num_labels if cfg.pooling == "rank" else cfg.hidden_size,
        pooling=cfg.pooling,
        tasks=cfg.tasks,
    )
    release_free_memory()
    return engine


def build_disk_tier(config: EngineConfig, model_dir, model, device, dtype_name, ops_name, kv_types, caches):
    """This model's view of the disk prompt cache (--prompt-cache-gb; shared by every model of the process),
    or None, logged, when its folder cannot be made: the daemon serves without it."""
    import logging
    from pathlib import Path

    from minibatch.engine.kv_offload.disk import default_folder, open_cache
    from minibatch.engine.kv_offload.identity import block_facts, identity_of
    from minibatch.engine.kv_offload.tier import DiskTier
    from minibatch.engine.runner.kv_cache import KVBlockIO

    cfg = model.config
    long = model.model.rotary.long if cfg.rope.rope_type == "longrope" else None
    facts = block_facts(
        config.model,
        model_dir,
        model.weights_desc,
        device,
        dtype_name,
        ops_name,
        str(kv_types),
        config.block_size,
        cfg.rope,
        None if long is None else ("long" if long else "short"),
    )
    folder = Path(config.prompt_cache_dir) if config.prompt_cache_dir else default_folder()
    try:
        cache = open_cache(folder, int(config.prompt_cache_gb * 2**30))
    except OSError as exc:
        logging.getLogger("minibatch.prompt_cache").warning(
            "prompt cache off for %s: cannot use %s (%s)", config.model, folder, exc.strerror or exc
        )
        return None
    identity = identity_of(facts)
    cache.describe(identity, facts)
    min_blocks = -(-config.prompt_cache_min_tokens // config.block_size)
    return DiskTier(cache, identity, KVBlockIO(caches), min_blocks)


def build_draft_proposer(
    spec, config: EngineConfig, tokenizer, backend, ops, device, dtype, num_blocks, max_len, kv_types: KVCacheTypes
):
    """The draft model of --speculative draft, loaded as the target is, with a KV pool of as many blocks;
    refused, naming both, when its vocabulary is not the target's."""
    from minibatch.engine.runner.kv_cache import allocate_kv_cache, types_problem
    from minibatch.engine.spec_decode.draft_model import DraftModelProposer
    from minibatch.engine.text.tokenizer import TextTokenizer
    from minibatch.engine.weights.loader import load_model

    draft_dir = resolve_model(spec.draft_model)
    theirs, ours = TextTokenizer(draft_dir).vocab(), tokenizer.vocab()
    if theirs != ours:
        differ = len(set(theirs.items()) ^ set(ours.items()))
        raise ValueError(
            f"draft_model {spec.draft_model!r} has another vocabulary than model {config.model!r} "
            f"({len(theirs)} tokens against {len(ours)}, {differ} entries differ): a draft must share the "
            "target's tokenizer"
        )
    draft = load_model(draft_dir, backend, device=device, dtype=dtype, ops=ops, weights=config.weights)
    draft.use_context(max_len, positions=(num_blocks - 1) * config.block_size)
    problem = types_problem(draft.config, kv_types)
    if problem:
        raise ValueError(f"draft_model {spec.draft_model!r}: kv_cache_type {kv_types}: {problem}")
    caches = allocate_kv_cache(draft.config, num_blocks, config.block_size, kv_types, device)
    return DraftModelProposer(draft, caches, num_blocks, config.block_size, vocab_size=len(ours))

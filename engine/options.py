"""The engine's options, defined once: `minibatchd start`, `minibatch-serve start`, their MINIBATCH_<NAME>
environment variables and EngineConfig all derive from this table. Each option is an EngineConfig field of
the same name; its default is that field's (whose scheduler limits are SchedulerConfig's defaults)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from minibatch.engine.core.info import WEIGHT_MODES
from minibatch.engine.factory import DTYPES, EngineConfig
from minibatch.engine.kv_offload.disk import DEFAULT_GB
from minibatch.engine.spec_decode.config import MAX_NUM_TOKENS, SPEC_METHODS
from minibatch.kernels.kv_types import KV_CACHE_TYPES


@dataclass(frozen=True, slots=True)
class Option:
    field: str  # the EngineConfig field
    type: type
    help: str
    served: float | None = None  # the servers' default where it is not the field's (None: the field's)

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")

    @property
    def env(self) -> str:
        return "MINIBATCH_" + self.field.upper()

    @property
    def default(self):
        return DEFAULTS[self.field] if self.served is None else self.served


DEFAULTS = {
    f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
    for f in dataclasses.fields(EngineConfig)
}

ENGINE_OPTIONS = (
    Option(
        "model",
        str,
        "the daemon's own model, loaded at start and used when a request names none: model alias, HF "
        "directory, .gguf file or hub id (any other model `minibatchd models` lists loads when a request names it)",
    ),
    Option("mode", str, "batching mode at start: continuous or static"),
    Option("max_num_seqs", int, "running requests at most (static: the batch size)"),
    Option("max_num_batched_tokens", int, "tokens per forward step"),
    Option(
        "max_model_len",
        int,
        "context limit (default: the model's; LongRoPE models: their original length, and past it the long factors)",
    ),
    Option("max_queue", int, "requests that may wait behind a full batch; more get 429"),
    Option("max_wait_ms", float, "static mode: longest wait for a batch to fill"),
    Option("kv_cache_gb", float, "KV cache size of each model in GiB (default: --kv-cache-fraction)"),
    Option(
        "kv_cache_fraction",
        float,
        "share of the memory available once a model is loaded that its KV cache takes (default 0.1 on CPU; "
        "on a GPU 0.8 of the free memory, divided by --max-loaded-models)",
    ),
    Option("kv_cache_tokens", int, "KV cache size in tokens, as llama.cpp's -c (instead of --kv-cache-gb)"),
    Option(
        "kv_cache_type",
        str,
        f"what the KV cache keeps K and V in: one of {', '.join(KV_CACHE_TYPES)} for both, or K_TYPE,V_TYPE "
        "(llama.cpp's -ctk/-ctv); auto: q8_0 on the CPU (f32 with exact weights: native-exact, fp32 "
        "safetensors), the model's dtype on a GPU",
    ),
    Option("block_size", int, "tokens per KV block"),
    Option("timeline_steps", int, "engine steps the timeline keeps (GET /v1/engine/steps, the chat's timeline)"),
    Option("device", str, "auto, cpu or cuda"),
    Option("dtype", str, f"{', '.join(DTYPES)} (auto: fp32 on CPU, bf16 on GPU)"),
    Option(
        "weights",
        str,
        f"{', '.join(WEIGHT_MODES)}: auto (native on CPU), native (GGUF blocks as they are, 8-bit activations, "
        "integer dot products), native-exact (GGUF blocks, fp32 activations: the dequantised model's results), "
        "float32 (dequantised at load), q8_0 (quantize a safetensors model at load)",
    ),
    Option(
        "speculative",
        str,
        f"speculative decoding: {', '.join(SPEC_METHODS)} (ngram: draft tokens looked up in the request's own "
        "prompt and output; draft: proposed by --draft-model; verified in one forward: the same answers, "
        "fewer steps)",
    ),
    Option(
        "num_speculative_tokens",
        int,
        f"draft tokens per row per step at most, 1 to {MAX_NUM_TOKENS} (fewer when the batch is large "
        "or a request's drafts keep failing)",
    ),
    Option(
        "draft_model",
        str,
        "with --speculative draft: a smaller model of the same vocabulary (any spec --model takes) whose greedy "
        "continuation is the draft",
    ),
    Option("threads", int, "PyTorch CPU threads (default: all cores)"),
    Option(
        "prompt_cache_gb",
        float,
        "disk the prompt cache may take, GiB: full KV blocks the prefix cache registers are kept on disk and read "
        "back when a later request's prompt starts with them, after a restart or an unload too (0: off)",
        served=DEFAULT_GB,
    ),
    Option("prompt_cache_dir", str, "the prompt cache's folder (default: prompt-cache/ in the user cache folder)"),
    Option(
        "cache_reuse",
        int,
        "fill-in-the-middle requests (/infill, a suffix) take runs of at least this many tokens of a recent prompt "
        "at shifted positions, keys turned to them, instead of computing them again (llama-server's --cache-reuse; "
        "0: off)",
    ),
    Option(
        "lora",
        str,
        "LoRA adapters served over the model: NAME=PATH pairs, comma-separated (Hugging Face PEFT folders or "
        "llama.cpp's LoRA GGUF files); a "
        "request names an adapter as its model, and rows of every adapter and of none run in the same steps",
    ),
    Option("max_lora_rank", int, "an adapter of a larger rank is refused at its load"),
    Option(
        "max_loras",
        int,
        "LoRA adapters resident at once: a request naming another loads it in place of the least recently used "
        "one that no request runs under (or waits for one to end)",
    ),
    Option(
        "lora_dir",
        str,
        "a folder of LoRA adapters (PEFT folders, LoRA GGUF files) served over the model by name on demand: a "
        "request names one by its folder's name or its file's without .gguf",
    ),
    Option(
        "mmproj",
        str,
        "the daemon's model's image tower and projector: llama.cpp's mmproj GGUF or a Hugging Face folder (default: "
        "the model folder's own, or an Ollama model's projector layer, when it has one)",
    ),
    Option("max_images", int, "images one request may send at most"),
    Option("max_image_bytes", int, "bytes one image may take, encoded (as sent, before base64)"),
    Option("max_image_pixels", int, "pixels (width x height) one image may have, read from its header before decoding"),
    Option(
        "prompt_cache_min_tokens",
        int,
        "a run of cached tokens on disk shorter than this is recomputed instead of read",
    ),
)


def engine_config(values: dict) -> EngineConfig:
    """An EngineConfig from parsed options (an argparse namespace's vars): every ENGINE_OPTIONS field,
    plus `no_prefix_caching`."""
    fields = {o.field: values[o.field] for o in ENGINE_OPTIONS}
    return EngineConfig(**fields, enable_prefix_caching=not values.get("no_prefix_caching", False))

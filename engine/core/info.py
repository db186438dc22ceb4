"""What the engine publishes about the model it runs: one typed record, made once at load.

The daemon (`/health`, Ollama's `/api/show`), the chat and the scripts read
these facts here instead of re-deriving them from files in the model cache,
which need not hold the weights at all (a GGUF's weights are read from the
GGUF file itself).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# How the weights run (--weights). auto: native on the CPU for a GGUF, float32 elsewhere.
WEIGHT_MODES = (
    "auto",
    "native",  # a GGUF's blocks as stored; 8-bit activations multiplied in integers (the CPU default)
    # a GGUF's blocks as stored, dequantised exactly for fp32 activations (the dequantised model's results)
    "native-exact",
    "float32",  # every matrix dequantised to fp32 at load (the reference; GPUs run it in bf16)
    "q8_0",  # a safetensors model's matrices quantized to Q8_0 at load, run as native
)


@dataclass(frozen=True, slots=True)
class WeightGroup:
    """The matrices of one kind (attention, mlp, embedding, output, norms) as they are held in memory."""

    name: str
    params: int  # values in the group's tensors
    bytes: int  # bytes those tensors take, in the form the forward reads them
    types: dict[str, int]  # storage type (Q4_K, Q6_K, F32, ...) -> params held in it


@dataclass(frozen=True, slots=True)
class WeightFacts:
    """The loaded weights: what they take in memory and what one decode step streams through the matmuls."""

    num_params: int  # distinct parameters (a tied output projection counted once)
    loaded_bytes: int  # distinct weight storage in memory
    # Bytes every decode step reads through its matrix multiplies (every layer's projections and the
    # output projection, each in the form it is stored; the embedding is a lookup of one row per token).
    # Divided into the machine's read bandwidth it bounds batch-1 decode speed.
    matmul_bytes_per_step: int
    matmul_params: int  # multiply-adds per token in those matmuls (2 flops each)
    groups: tuple[WeightGroup, ...] = ()


@dataclass(frozen=True, slots=True)
class VisionFacts:
    """A vision model's tower and the bounds on what a request sends (--max-images, --max-image-bytes,
    --max-image-pixels)."""

    family: str  # engine/vision/'s: gemma3, idefics3
    source: str  # where the tower came from: the model folder, or mmproj (its file's name)
    image_size: int  # the side the tower sees an image (or each of its tiles) at, in pixels
    tokens_per_image: int  # positions one view of an image takes in the prompt (the whole image, or a tile)
    max_image_positions: int  # positions the largest image takes, its tiles' runs and the tokens around them
    max_images: int
    max_image_bytes: int
    max_image_pixels: int


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """Static facts about a running engine. The live state (mode, occupancy, KV use) is in StepStats."""

    model: str
    model_dir: str
    family: str
    device: str
    dtype: str
    weights: str  # what the matrices run as, e.g. "Q4_1 (+Q8_0 embedding) native"
    attention: str
    ops: str
    block_size: int
    num_kv_blocks: int
    kv_budget: str  # which rule sized the KV pool
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    generation_defaults: dict[str, float] = field(default_factory=dict)
    rope_factors: str | None = None  # LongRoPE: which factors this run rotates with
    speculative: str = "off"  # speculative decoding: off, "ngram (up to K tokens)", "draft MODEL (up to K tokens)"
    memory: WeightFacts | None = None
    kv_cache_bytes: int = 0  # the KV pool: what it takes once every block is written
    kv_cache_type: str = "f32"  # what K and V are kept in: TYPE, or K_TYPE,V_TYPE (kernels/kv_types.py)
    kv_bytes_per_token: int = 0  # one token's K and V across all layers
    kv_cache_tokens: int = 0  # tokens the pool holds: its blocks (less the null block) times block_size
    embedding_size: int = 0  # an embedding's length (the hidden size)
    pooling: str = "last"  # how an embedding pools the prompt's hidden states (ModelConfig.pooling)
    # what the model does (engine/encoders/config.py TASKS): a decoder generates and embeds; an encoder embeds,
    # or, with a classification head, reranks
    tasks: tuple[str, ...] = ("generate", "embed")
    # the CPU kernels: their build and what the integer dot products run on (kernels.cpu.extension.describe)
    cpu_kernels: str | None = None
    loras: tuple[str, ...] = ()  # the LoRA adapters its --lora names (a request names one as its model)
    vision: VisionFacts | None = None  # a model that sees images: its tower and what a request may send

    def as_dict(self, public: bool = False) -> dict:
        """JSON-ready: the fields, with `memory` nested (None fields left out); `public`: without the server's
        own paths (what the API shows its clients)."""
        out = asdict(self)
        if public:  # the spec may be the operator's path: the API shows the model's name beside these
            del out["model_dir"], out["model"]
        out["eos_token_ids"] = list(self.eos_token_ids)
        out["tasks"] = list(self.tasks)
        return {k: v for k, v in out.items() if v is not None}

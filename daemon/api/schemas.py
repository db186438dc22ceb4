"""The shapes of the daemon's JSON answers, as pydantic models: the OpenAPI document (openapi.py) is made
from them and the request models of protocol.py and ollama.py, and the API fuzz test checks every answer
the daemon gives against that document, so a handler that drifts from its model fails there.

Objects allow fields beyond the ones listed (clients ignore what they do not know; OpenAI adds fields
too); the listed ones are required unless they have a default here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, RootModel

from minibatch.engine.core.outputs import StepStats


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


# -- errors -------------------------------------------------------------------
class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error of the OpenAI-compatible and native endpoints."""

    model_config = ConfigDict(extra="forbid")
    error: ErrorDetail


class OllamaError(BaseModel):
    """Every error of Ollama's endpoints: the message, naming the field."""

    model_config = ConfigDict(extra="forbid")
    error: str


class AnthropicErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str  # invalid_request_error, authentication_error, not_found_error, ...
    message: str


class AnthropicError(BaseModel):
    """Every error of Anthropic's endpoints, in Anthropic's shape."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["error"]
    error: AnthropicErrorDetail


# -- OpenAI-compatible --------------------------------------------------------
class Timings(_Out):
    queue_wait_ms: float | None = None
    ttft_ms: float | None = None
    decode_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    preemptions: int = 0
    cached_prompt_tokens: int = 0
    draft_tokens: int = 0  # speculative decoding: tokens proposed and verified for this request
    accepted_tokens: int = 0  # of them accepted


class PromptDetails(_Out):
    cached_tokens: int


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptDetails


class ToolCallOut(_Out):
    id: str
    type: Literal["function"]
    function: dict[str, str]


class AssistantMessage(_Out):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    minibatch: Timings


class CompletionChoice(_Out):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None


class Completion(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    minibatch: Timings


class ModelCard(_Out):
    id: str  # the name a request gives
    object: Literal["model"]
    created: int
    owned_by: str
    loaded: bool  # loaded now (else it loads on first use)
    max_model_len: int | None  # known once loaded
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field); a model's: none
    vision: bool = False  # it takes images (a vision folder, or a model loaded with --mmproj)


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


# -- native -------------------------------------------------------------------
class Health(_Out):
    """The daemon's state; once the model is loaded, the engine's facts (EngineInfo) and its mode too."""

    status: Literal["ok", "loading", "draining", "failed"]
    model: str
    uptime_s: float
    last_error: str | None
    last_error_time: float | None
    pid: int
    models: list[LoadedModelFacts] = []  # every loaded model
    loading: list[str] = []  # names being loaded now
    load_errors: dict[str, str] = {}  # the last load error by name


class ResidentLora(_Out):
    name: str
    size: int  # bytes its matrices take as the kernels keep them


class LoadedModelFacts(_Out):
    """One loaded model in /health: the engine's facts (EngineInfo) and its lifetime."""

    name: str
    mode: Literal["continuous", "static"]
    running: int
    waiting: int
    alive: bool
    loaded_at: str
    load_seconds: float
    expires_at: str  # Ollama's form; 0001-01-01T00:00:00Z: kept loaded
    memory_bytes: int  # weights, resident LoRA adapters and KV pool
    loras: list[str] = []  # the LoRA adapters it may serve by name (a `lora` list's ids are places here)
    loras_resident: list[ResidentLora] = []  # those resident now (--max-loras), most recently used first
    lora_bytes: int = 0  # what the resident ones take, as the kernels read them


class ModelStats(_Out):
    """Each loaded model's occupancy in /v1/engine/stats' `models` and the events' `models`."""

    mode: Literal["continuous", "static"] | None = None
    pending_mode: Literal["continuous", "static"] | None = None
    running: int | None = None
    max_num_seqs: int | None = None
    waiting: int | None = None
    kv_blocks_used: int | None = None
    kv_blocks_total: int | None = None
    kv_usage_percent: float | None = None
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    steps_per_s: float | None = None
    state: Literal["ready", "failed", "loading"] | None = None  # the events' `models` only


class Stats(_Out):
    mode: Literal["continuous", "static"]
    pending_mode: Literal["continuous", "static"] | None
    running: int
    max_num_seqs: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_usage_percent: float
    block_size: int
    prefix_cache_hit_rate: float
    prompt_tokens: int
    cached_prompt_tokens: int
    prefix_cache_hit_blocks: int
    kv_window: int
    kv_blocks_released_out_of_window: int
    preemptions: int
    wasted_row_steps: int
    requests_finished: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    steps_per_s: float
    cpu_wait_share: float | None  # the last 2 s: the engine threads' wait for a core per second of step
    acceptance_rate: float | None  # the last 2 s: speculative tokens accepted / verified (None: none verified)
    tokens_per_verify_row: float | None  # the last 2 s: tokens a row that verified a draft took per step
    speculative: str  # the proposer: off or ngram
    draft_tokens: int  # over the engine's life
    accepted_tokens: int
    verify_rows: int
    reused_tokens: int  # over the engine's life: prompt positions filled by shifted reuse (--cache-reuse)
    disk_cache: bool  # the disk prompt cache is on for this model (--prompt-cache-gb)
    disk_hit_blocks: int  # over the engine's life: blocks read back from disk as prefix hits
    disk_loading_requests: int  # now: requests waiting off the queue for their blocks from disk
    disk_read_bytes: int
    disk_written_blocks: int
    disk_written_bytes: int
    disk_bad_blocks: int  # torn, corrupt or vanished files found: misses, removed
    disk_write_errors: int  # writes the disk refused (full, read-only): misses, logged
    disk_skipped_blocks: int  # not written: the writer was behind
    last_error: str | None
    # a vision model's tower (absent for one without): images of requests waiting for it or in it now, and over
    # the model's life those encoded, those found again among the recent ones, and the seconds it took
    images_queued: int | None = None
    images_encoded: int | None = None
    image_hits: int | None = None
    image_seconds: float | None = None
    recent_steps: list[StepStats]
    model: str  # which loaded model this is (?model=, default the daemon's own)
    models: dict[str, ModelStats] = {}  # without ?model=: every loaded model's
    totals: dict[str, float] = {}  # without ?model=: their sums


class LlamaTimings(_Out):
    prompt_n: int  # prompt tokens computed (the cached ones not)
    prompt_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_second: float


class LlamaCompletion(_Out):
    """llama-server's /completion and /infill answer (and a stream's last event); with response_fields, only
    those (a path as "timings/prompt_n" under that name)."""

    content: str | None = None
    stop: bool | None = None
    model: str | None = None
    tokens_predicted: int | None = None
    tokens_evaluated: int | None = None
    tokens_cached: int | None = None
    stop_type: Literal["eos", "limit", "word"] | None = None
    stopping_word: str | None = None
    truncated: bool | None = None
    has_new_line: bool | None = None
    timings: LlamaTimings | None = None


class PromptCacheModel(_Out):
    model: str  # as the request names it; the daemon's own user sees the path it was loaded from
    loaded: bool
    kv_cache_type: str | None
    block_size: int | None
    weights: str | None
    # to the daemon's own user only (the counts sum every key's prompts):
    identity: str | None = None  # the folder's name: a digest of what decides its blocks' contents
    blocks: int | None = None
    bytes: int | None = None
    last_used: float | None = None  # wall time of its newest block


class PromptCache(_Out):
    """GET /v1/prompt-cache: the disk prompt cache's folder."""

    enabled: bool
    budget_bytes: int
    models: list[PromptCacheModel]
    # to the daemon's own user only:
    bytes: int | None = None
    blocks: int | None = None
    evicted_blocks: int | None = None  # removed for the budget since the daemon started
    folder: str | None = None


class PromptCacheCleared(_Out):
    removed_blocks: int
    removed_bytes: int


class BlockMap(_Out):
    total: int
    owners: dict[str, list[int]]
    shared: list[int]
    block_size: int | None = None  # from the first refresh on
    cached_free: int | None = None
    adapters: dict[str, str] = {}  # owners under LoRA adapters -> their names, "+"-joined


class StepRecord(_Out):
    step: int
    t: float
    ms: float
    mode: str
    waiting: int
    rows: list[list[Any]]  # [row, request id, tokens, state, draft tokens verified, of them accepted]
    preempted: list[str]
    adapters: dict[str, str]  # request id -> the LoRA adapters its row runs under ("+"-joined), rows under any


class Timeline(_Out):
    last_step: int
    capacity: int
    max_rows: int
    states: dict[str, str]
    steps: list[StepRecord]


class LoraAdapter(_Out):
    id: int  # its place in the model's --lora list: what a request's `lora` names it by
    name: str  # what a request's `model` names it by
    scale: float  # what requests that name the base model and give no `lora` run it under (0: not applied)


class LoraAdapters(RootModel[list[LoraAdapter]]):
    """llama-server's GET /lora-adapters: a bare list."""


class Modalities(_Out):
    vision: bool
    audio: bool


class Props(_Out):
    """llama-server's GET /props: a loaded model's slots, context, chat template and what it takes in."""

    model_alias: str
    total_slots: int
    default_generation_settings: dict[str, Any]
    chat_template: str
    modalities: Modalities
    media_marker: str  # where each of /completion's multimodal_data images goes in its prompt string


class ModeState(_Out):
    mode: Literal["continuous", "static"]
    pending_mode: Literal["continuous", "static"] | None


class ModeSwitch(_Out):
    mode: Literal["continuous", "static"]
    requested_mode: Literal["continuous", "static"]
    models: list[str]  # the models switched


class ModeRequest(BaseModel):
    """PUT /v1/engine/mode's body."""

    model_config = ConfigDict(extra="forbid", strict=True)
    mode: Literal["continuous", "static"]


# -- Ollama -------------------------------------------------------------------
class OllamaDetails(_Out):
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class OllamaModel(_Out):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: OllamaDetails


class OllamaTags(_Out):
    models: list[OllamaModel]


class OllamaRunning(OllamaModel):
    size_vram: int
    expires_at: str
    context_length: int  # the context limit it was loaded with (newer Ollama's field)
    kv_cache_type: str  # what its KV cache keeps K and V in (EngineInfo.kv_cache_type)
    kv_bytes_per_token: int
    kv_cache_tokens: int  # tokens its KV pool holds
    loras: list[ResidentLora] = []  # its LoRA adapters resident now, most recently used first


class OllamaPs(_Out):
    models: list[OllamaRunning]


class OllamaShow(_Out):
    details: OllamaDetails
    model_info: dict[str, Any]
    # a coder model's fill-in-the-middle markers in Ollama's template words (`.Suffix`), else empty
    template: str
    capabilities: list[str]  # "completion", "insert" where a `suffix` is taken, "vision" where images are


class OllamaVersion(_Out):
    version: str


class OllamaMessageOut(_Out):
    role: Literal["assistant"]
    content: str


class OllamaChatAnswer(_Out):
    model: str
    created_at: str
    message: OllamaMessageOut
    done: bool


class OllamaGenerateAnswer(_Out):
    model: str
    created_at: str
    response: str
    done: bool


SHOW_NAMED = {  # the handler takes `model`, else `name`: one of them must be a name
    "anyOf": [
        {"required": ["model"], "properties": {"model": {"type": "string"}}},
        {"required": ["name"], "properties": {"name": {"type": "string"}}},
    ]
}


class OllamaShowRequest(_Out):
    """POST /api/show's body: the model's name, under either key."""

    model_config = ConfigDict(extra="allow", json_schema_extra=SHOW_NAMED)
    model: str | None = None
    name: str | None = None  # older clients send the name here


# -- Anthropic ------------------------------------------------------------------
class AnthropicMessageOut(_Out):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]  # text and tool_use blocks
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: dict[str, int]


class TokenCount(_Out):
    input_tokens: int


class Tokenized(_Out):
    """POST /tokenize's answer: the ids (or, with_pieces, {"id", "piece"} each), their count, the context."""

    model: str
    tokens: list[int] | list[dict[str, Any]]
    count: int
    max_model_len: int


class Detokenized(_Out):
    model: str
    content: str


# -- embeddings -----------------------------------------------------------------
class EmbeddingItem(_Out):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # floats, or with encoding_format base64 their little-endian float32 bytes


class EmbeddingUsage(_Out):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(_Out):
    """POST /v1/embeddings's answer: one vector of length 1 per input, in the inputs' order."""

    object: Literal["list"]
    data: list[EmbeddingItem]
    model: str
    usage: EmbeddingUsage


class RerankDocument(_Out):
    text: str


class RerankResult(_Out):
    index: int  # the document's place in the request
    relevance_score: float  # the reranker's logit for the pair (higher: more relevant)
    document: RerankDocument | None = None  # with return_documents


class RerankAnswer(_Out):
    """POST /v1/rerank's answer (Jina's and Cohere's shape): the documents best first, top_n of them."""

    id: str
    object: Literal["list"]
    model: str
    results: list[RerankResult]
    usage: EmbeddingUsage


class TeiRank(_Out):
    index: int
    score: float  # the sigmoid of the logit, or the logit with raw_scores
    text: str | None = None  # with return_text


class RerankOrTei(RootModel[RerankAnswer | list[TeiRank]]):
    """The rerank endpoints' answer: Jina's and Cohere's shape, or TEI's list when the documents came as `texts`."""


class OllamaEmbedAnswer(_Out):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class OllamaEmbeddingAnswer(_Out):
    embedding: list[float]


# -- Responses ------------------------------------------------------------------
class ResponseOut(_Out):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict[str, Any]]  # message and function_call items
    usage: dict[str, Any] | None


class ResponseDeleted(_Out):
    id: str
    object: Literal["response.deleted"]
    deleted: bool

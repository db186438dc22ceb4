"""Shared fixtures: tiny random models saved as Hugging Face directories, and the built-in model."""

from __future__ import annotations

import json
import os
import platform
import tempfile
from pathlib import Path

import pytest

# `make test` runs a worker per core (pytest-xdist). Each worker, and every daemon or script it starts, then
# computes on one thread: with two threads per process on a machine already full of processes,
# each parallel region would wait at its barrier for a thread another process preempted. Tests of the threaded
# paths set their thread counts themselves; a plain `pytest` run keeps torch's default.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Daemons the tests start keep no disk prompt cache (an earlier test's blocks would be hits), except where a test
# turns it on with a folder of its own; and the folder they would list or clear is never the user's.
os.environ["MINIBATCH_PROMPT_CACHE_GB"] = "0"
os.environ["MINIBATCH_PROMPT_CACHE_DIR"] = tempfile.mkdtemp(prefix="mb-test-prompt-cache-")

# The Triton interpreter multiplies tiles (tl.dot) with numpy's matmul on OpenBLAS, whose AVX2 kernels (its
# Haswell and Zen ones) give a row other bits by its place in the tile; a GPU's tile multiply does not, and
# the Triton tests hold a token's bits whatever its batch. So the tests pin OpenBLAS's SSE3 kernels
# (Prescott's: every x86-64 CPU has them), whose rows do not depend on their place, before anything loads it:
# tests/kernels/test_triton_kernels.py's same-bits test failed 3 of 4 on an AVX2-only EPYC with the Zen
# kernels and passed with these (and with Sandybridge's), as it does with the AVX-512 ones.
if platform.machine() in ("x86_64", "AMD64"):
    os.environ.setdefault("OPENBLAS_CORETYPE", "Prescott")

# Triton kernels run in the interpreter on a machine without a GPU; it must be chosen
# before any kernel is defined, so before any test module imports one.
try:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

# The modules with the longest tests come first, so that on several workers they end while the others still
# have short modules to take, not alone at the end.
LONGEST_FIRST = (
    "tests/scripts/test_readme_scripts_own_daemons.py",
    "tests/scripts/test_readme_scripts_in_process.py",
    "tests/scripts/test_readme_scripts.py",
    "tests/scripts/test_gpu_check.py",
    "tests/engine/test_engine_model.py",
    "tests/engine/test_batch_invariance_portable.py",
    "tests/engine/test_batch_invariance.py",
    "tests/scripts/test_bench.py",
    "tests/cluster/",
)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        return next((i for i, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)), len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: the order within each stays


TINY_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def _save_tiny(kind: str, path: Path) -> Path:
    import torch
    import transformers

    torch.manual_seed(0 if kind == "llama" else 1)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            **TINY_COMMON,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 50000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**TINY_COMMON, tie_word_embeddings=False, rope_theta=10000.0)
        model = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # random init zeroes biases; make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return _save_tiny("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return _save_tiny("qwen2", tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def builtin_model_dir() -> Path:
    """The built-in model, converted once into the user cache dir (reused across runs)."""
    from minibatch.engine.store.cache import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture
def short_tmp():
    """A short temp dir: Unix socket paths must stay under 108 bytes."""
    with tempfile.TemporaryDirectory(prefix="mb-", dir="/tmp") as d:
        os.chmod(d, 0o700)
        yield Path(d)


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
)


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory, builtin_model_dir) -> Path:
    """A tiny random Llama with the built-in model's tokenizer and chat template: fast, but speaks our protocol."""
    import shutil

    path = save_tiny_chat(tmp_path_factory.mktemp("tiny-chat"), seed=0)
    for name in TOKENIZER_FILES:
        if (builtin_model_dir / name).exists():
            shutil.copy(builtin_model_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_vision_model_dir(tmp_path_factory, builtin_model_dir) -> Path:
    """A tiny random Gemma 3 vision folder (tests/vision_model.py): a tower, a projector, image tokens."""
    from tests.vision_model import save_tiny_gemma3_vision

    return save_tiny_gemma3_vision(tmp_path_factory.mktemp("gemma3-vision"), builtin_model_dir)


@pytest.fixture(scope="session")
def tiny_smolvlm_dir(tmp_path_factory, builtin_model_dir) -> Path:
    """A tiny random SmolVLM (Idefics3) folder (tests/vision_model.py): a tower that cuts images into tiles."""
    from tests.vision_model import save_tiny_smolvlm

    return save_tiny_smolvlm(tmp_path_factory.mktemp("smolvlm"), builtin_model_dir)


def save_tiny_chat(path: Path, seed: int, layers: int = TINY_COMMON["num_hidden_layers"]) -> Path:
    """A tiny random Llama with the built-in model's vocabulary size (its tokenizer files copied in by the caller)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        **{**TINY_COMMON, "vocab_size": 49152, "max_position_embeddings": 1024, "num_hidden_layers": layers},
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def make_lora(base_dir: Path, out_dir: Path, targets: list[str], rank: int, alpha: float, rslora: bool, seed: int):
    """A random PEFT LoRA adapter of the model in `base_dir`, written to `out_dir`: its B matrices are not zero
    (as after training, unlike PEFT's initial ones) and large enough to change a tiny model's greedy answer."""
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False, lora_dropout=0.0
    )
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(out_dir)
    return out_dir


def write_gguf_lora(peft_dir: Path, out: Path, arch: str, heads: int, kv_heads: int) -> Path:
    """The PEFT adapter in `peft_dir` as llama.cpp's convert_lora_to_gguf.py writes it (checked tensor for
    tensor against the converter's own output): `blk.N.attn_q.weight.lora_a`/`lora_b` in f32, Q's and K's B
    rows permuted for the `llama` architecture as the base's are, `adapter.lora.alpha`."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    conf = json.loads((peft_dir / "adapter_config.json").read_text())
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
    names |= {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(conf["lora_alpha"]))
    tensors = {}
    for key, value in load_file(peft_dir / "adapter_model.safetensors").items():
        parts = key.split(".")
        layer, module, ab = parts[parts.index("layers") + 1], parts[-3], parts[-2]
        if ab == "lora_B" and arch == "llama" and module in ("q_proj", "k_proj"):
            n = heads if module == "q_proj" else kv_heads
            rows = value.shape[0]
            value = value.reshape(n, 2, rows // n // 2, -1).swapaxes(1, 2).reshape(rows, -1)
        tensors[f"blk.{layer}.{names[module]}.weight.{ab.lower()}"] = np.ascontiguousarray(value, dtype=np.float32)
    for name in sorted(tensors):
        writer.add_tensor(name, tensors[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out

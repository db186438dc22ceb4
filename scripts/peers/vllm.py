"""vLLM's OpenAI server on an NVIDIA GPU (`pip install vllm` on that machine), same HF model directory."""

from __future__ import annotations

import importlib.util
import shutil
import sys

from . import Launch


def available() -> bool:
    if shutil.which("vllm") is None and importlib.util.find_spec("vllm") is None:
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def command(model_dir: str, port: int, concurrency: int, max_model_len: int) -> list[str]:
    exe = shutil.which("vllm")
    head = [exe, "serve"] if exe else [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    return head + [
        model_dir,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-num-seqs",
        str(max(1, concurrency)),
        "--max-model-len",
        str(max_model_len),
        "--disable-log-requests",
        "--served-model-name",
        "model",
    ]


def launch(model_dir: str, port: int, concurrency: int, max_model_len: int) -> Launch:
    if not available():
        raise SystemExit("vLLM peer: needs vllm installed and an NVIDIA GPU")
    return Launch(
        name="vLLM",
        argv=command(model_dir, port, concurrency, max_model_len),
        url=f"http://127.0.0.1:{port}",
        info={"model_dir": model_dir},
        model="model",
    )

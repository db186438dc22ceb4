"""bench_lora.py (docs/scripts.md) on its own daemon over the built-in model, with random adapters of its shape it
writes itself: both phases measured, llama.cpp's side only with a llama-server."""

from __future__ import annotations

import json

import gguf
import pytest

from tests.scripts.helpers import SCRIPTS, run

pytestmark = pytest.mark.model


def test_bench_lora(env, tmp_path):
    out = tmp_path / "lora.json"
    args = ["--model", "smollm2-135m-instruct", "--shape", "smollm2-135m", "--cache", tmp_path / "cache"]
    args += ["--adapters", "2", "--rank", "4", "--clients", "2", "--requests", "1", "--tokens", "4", "--repeats", "1"]
    args += ["--threads", "1", "--json", out]
    env = {k: v for k, v in env.items() if k != "LLAMA_SERVER"}
    proc = run(env, SCRIPTS / "features" / "bench_lora.py", *args, timeout=600)
    report = json.loads(out.read_text())
    mine = report["minibatch"]
    assert mine["base_tokens_s"] > 0 and mine["adapters_tokens_s"] > 0 and "llama.cpp" not in report
    assert "| minibatch |" in proc.stdout
    # the adapters it wrote are llama.cpp's LoRA layout, rank 4 on every projection of every layer
    adapters = sorted((tmp_path / "cache").glob("lora-smollm2-135m-r4-*.gguf"))
    assert len(adapters) == 2
    reader = gguf.GGUFReader(str(adapters[0]))
    assert reader.fields["general.type"].contents() == "adapter"
    assert len(reader.tensors) == 30 * 7 * 2 and reader.tensors[0].data.shape[0] in (4, 576, 1536, 192)

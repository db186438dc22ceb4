"""The retrieval scripts (docs/scripts.md: make_encoder.py, bench_retrieval.py), in a module of their own: the
tests run a module per worker, and the other script modules are the longest already (test_readme_scripts.py)."""

from __future__ import annotations

import json

import pytest
from make_encoder import SHAPES, save_bert, save_xlmr_reranker, write_encoder_gguf

from tests.scripts.helpers import SCRIPTS, run

pytestmark = pytest.mark.model


def test_bench_retrieval(env, tmp_path):
    """Its own daemons on one-layer encoder files it is given: embeddings and rerank rates; llama.cpp's side
    only with a llama-server."""
    one_layer = {"num_hidden_layers": 1}
    embed = save_bert(tmp_path / "minilm", pooling="mean", shape=SHAPES["minilm"] | one_layer)
    rerank = save_xlmr_reranker(tmp_path / "reranker", shape=SHAPES["bge-reranker-base"] | one_layer)
    models = [
        write_encoder_gguf(embed, tmp_path / "minilm.gguf", 1),
        write_encoder_gguf(rerank, tmp_path / "r.gguf", 4),
    ]
    out = tmp_path / "retrieval.json"
    args = ["--embed-model", models[0], "--rerank-model", models[1], "--passages", "6", "--words", "20"]
    args += ["--batch", "2", "--documents", "5", "--queries", "1", "--threads", "1"]
    env = {k: v for k, v in env.items() if k != "LLAMA_SERVER"}
    proc = run(env, SCRIPTS / "features" / "bench_retrieval.py", *args, "--json", out, timeout=600)
    report = json.loads(out.read_text())
    assert report["embed"]["minibatch"]["passages_s"] > 0 and report["embed"]["minibatch"]["tokens_s"] > 0
    assert report["rerank"]["minibatch"]["documents_s"] > 0 and "| minibatch |" in proc.stdout


def test_make_encoder(env, tmp_path):
    """A MiniLM-shaped encoder (one layer) as a folder and an F16 GGUF beside it: both load as encoders of 384
    wide rows, and the GGUF's vector is the folder's within F16's rounding."""
    out = tmp_path / "minilm"
    proc = run(env, SCRIPTS / "dev" / "make_encoder.py", "--shape", "minilm", "--layers", "1", "--out", out)
    assert f"wrote {out}/ and {out}.gguf" in proc.stdout
    check = f"""
import json, torch
from minibatch.engine.factory import EngineConfig, build_engine
from minibatch.engine.core.sampling_params import SamplingParams
vectors = []
for m in ({str(out)!r}, {str(out) + ".gguf"!r}):
    e = build_engine(EngineConfig(model=m))
    ids = e.tokenizer.encode_prompt("the cat sat on the mat")
    e.add_request("a", ids, SamplingParams(max_tokens=1), pooling=e.info.pooling)
    done = []
    while e.has_work():
        done += [o for o in e.step()[0] if o.finished]
    vectors.append(torch.tensor(done[0].embedding))
cos = torch.nn.functional.cosine_similarity(vectors[0], vectors[1], dim=0).item()
layers = e.runner.model.config.num_layers
print(json.dumps({{"size": len(vectors[0]), "cos": cos, "layers": layers, "tasks": list(e.info.tasks)}}))
"""
    info = json.loads(run(env, "-c", check).stdout.strip().splitlines()[-1])
    assert info["size"] == 384 and info["layers"] == 1 and info["tasks"] == ["embed"] and info["cos"] > 0.9999

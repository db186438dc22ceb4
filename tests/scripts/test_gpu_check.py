"""scripts/dev/gpu_check.py without a GPU: the refusal, the bare-machine bootstrap, the bf16 arithmetic, and the whole
pipeline on the CPU with a tiny model (--smoke-cpu), so the first GPU run does not find the script's own bugs."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "dev" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "scripts" / "dev"))

import gpu_check  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_it_needs_one(tmp_path):
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--report", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and "needs an NVIDIA GPU" in r.stderr, r.stderr
    assert not (tmp_path / "r.json").exists()


def test_bf16_spacing():
    assert gpu_check.bf16_spacing(1.0) == 2**-7
    assert gpu_check.bf16_spacing(-1.5) == 2**-7
    assert gpu_check.bf16_spacing(10.0) == 0.0625 and gpu_check.bf16_spacing(20.0) == 0.125
    x = 13.7
    assert (
        torch.tensor(x).to(torch.bfloat16).item()
        != torch.tensor(x + gpu_check.bf16_spacing(x)).to(torch.bfloat16).item()
    )


def test_bootstrap_unpacks_only_what_is_missing_and_names_what_it_cannot_find(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "mbfake_present-1.0-py3-none-any.whl", "w") as z:
        z.writestr("json/__init__.py", "raise ImportError('must not shadow the standard library')\n")
        z.writestr("mbfake_present-1.0.dist-info/METADATA", "Name: x\n")
    with zipfile.ZipFile(wheels / "mbfake_gpu_dep-1.0-py3-none-any.whl", "w") as z:
        z.writestr("mbfake_gpu_dep/__init__.py", "VALUE = 42\n")
        z.writestr("mbfake_gpu_dep-1.0.dist-info/METADATA", "Name: mbfake_gpu_dep\n")
    added = gpu_check.bootstrap(tmp_path / "work", wheels, needed=("mbfake_gpu_dep",))
    try:
        import mbfake_gpu_dep

        assert mbfake_gpu_dep.VALUE == 42
        assert not (tmp_path / "work" / "site" / "json").exists()  # importable already: left in its wheel
    finally:
        for p in added:
            sys.path.remove(p)
    with pytest.raises(SystemExit, match="mbfake_absent"):
        gpu_check.bootstrap(tmp_path / "work2", wheels, needed=("mbfake_absent",))
    with pytest.raises(SystemExit, match="gpu_wheels.sh"):
        gpu_check.bootstrap(tmp_path / "work3", tmp_path / "nowhere", needed=("mbfake_absent",))


def test_bootstrap_imports_minibatch_from_the_working_tree_without_an_install(tmp_path):
    """-S: no site-packages, so no installed minibatch; the bootstrap links the tree's folders into a package root."""
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT / 'scripts' / 'dev')!r}); import gpu_check; "
        "from pathlib import Path; "
        f"print(gpu_check.bootstrap(Path({str(tmp_path)!r}), None, needed=())); "
        "import minibatch.kernels.gpu.triton_support as t; print(t.__file__)"
    )
    r = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert str(tmp_path / "pkgroot") in r.stdout and "kernels/gpu/triton_support.py" in r.stdout


def test_a_failing_measurement_is_reported_and_the_check_goes_on():
    report: dict = {}

    def broken():
        raise RuntimeError("no such kernel")

    assert gpu_check.guarded(report, "a", lambda: {"x": 1}) and report["a"] == {"x": 1}
    assert not gpu_check.guarded(report, "b", lambda: ({"y": 2}, False)) and report["b"] == {"y": 2}
    assert not gpu_check.guarded(report, "c", broken)
    assert report["c"]["error"] == "RuntimeError: no such kernel" and "broken" in report["c"]["traceback"]


def test_the_whole_check_runs_on_the_cpu_with_a_tiny_model(tmp_path):
    report = tmp_path / "report.json"
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke-cpu", "--report", str(report)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["ok"] and data["mode"] == "smoke-cpu"
    assert data["fp32_parity"]["ok"] and data["fp32_parity"]["max_abs_logit_diff"] < 1e-3
    assert all(g["agree"] == g["of"] for g in data["fp32_parity"]["greedy"])
    assert data["graphs_vs_eager"]["equal"] and data["bf16_vs_fp32"]["ok"]
    assert set(data["decode_tok_s"]) == {"1", "16"} and all(
        v["graphs"] > 0 and v["eager"] > 0 for v in data["decode_tok_s"].values()
    )
    peer = data["peer"]
    assert peer["minibatch"]["tokens"] == peer["requests"] * peer["new_tokens"]
    assert "tok_s" in peer["transformers_generate_batch"], peer
    runs = data["attention_bandwidth"]["runs"]  # the interpreter's: the code, not the numbers
    assert {(a["kv_type"], a["batch"]) for a in runs} == {("f32", 1), ("f32", 2), ("q8_0", 1), ("q8_0", 2)}
    gguf = data["gguf"]  # a Qwen2 GGUF of mixed block types and a 151,936-token vocabulary
    assert gguf["vocab"] == 151936 and gguf["types"]["matrices"] == "Q4_K"
    assert gguf["fp32_vs_transformers"]["ok"] and not gguf["bf16_vs_fp32"]["unexplained_divergences"]
    assert all(v["graphs"] > 0 and v["graphs_chat_sampled"] > 0 for v in gguf["decode_tok_s"].values())
    assert "gpu-check (smoke-cpu): PASS" in r.stdout and "GGUF qwen2" in r.stdout

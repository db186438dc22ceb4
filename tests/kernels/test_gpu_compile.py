"""The Triton kernels the GPU engine launches compile for Hopper (sm_90, the H100 and H200 `make gpu-check`
runs on; `python -m tests.kernels.gpu_compile_cases 80` checks Ampere the same way), here, without a GPU:
Triton's own compiler and the ptxas it ships build each kernel in the configurations the engine uses
(tests/kernels/gpu_compile_cases.py). The interpreter runs a kernel's Python, not its compilation (a variable
whose type differs between branches, an operation a backend lacks), so this finds what only a device would,
before one is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def nvidia_backend() -> bool:
    from triton.backends import backends

    return "nvidia" in backends


@pytest.mark.skipif(not nvidia_backend(), reason="this Triton has no NVIDIA backend")
@pytest.mark.parametrize("arch", [90])
def test_every_gpu_kernel_compiles(arch, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # compiled here, not found in a cache
    r = subprocess.run(
        [sys.executable, "-m", "tests.kernels.gpu_compile_cases", str(arch)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    results = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(results) >= 20, r.stdout[-2000:]
    failed = [f"{x['case']}: {x['error']}" for x in results if not x["ok"]]
    assert not failed, "\n".join(failed)

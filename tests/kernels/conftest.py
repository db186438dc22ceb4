"""Triton kernels run compiled on a CUDA GPU and in Triton's interpreter on CPU.

The interpreter has to be chosen before any kernel is defined, so this runs
before the kernel modules are imported by the tests.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def skip_if_gpu_unusable() -> None:
    """On a machine whose GPU torch cannot use, say so.

    The Triton tests would pass in the interpreter there and prove nothing.
    """
    from minibatch.kernels.gpu.triton_support import cuda_device_unusable

    why = cuda_device_unusable()
    if why:
        pytest.skip(f"{why}; the Triton kernel tests need the GPU, not the interpreter", allow_module_level=True)


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(scope="session", params=["this-cpu", "avx2", "portable"])
def any_build(request):
    """The C++ extension as built for this CPU, for AVX2 without VNNI, and for x86-64's baseline (the scalar
    loops): every path, whichever this machine would take."""
    from minibatch.kernels.cpu.extension import load_cpu_extension, load_other_build, native_is

    ext = load_cpu_extension()
    if ext is None:
        pytest.skip("the C++ extension cannot be built here")
    if request.param == "this-cpu":
        return ext
    if native_is(request.param):
        pytest.skip(f"this CPU's own build is the {request.param} one: the this-cpu runs are these")
    other = load_other_build(request.param)
    assert other.int_path_has_avx2() == (request.param == "avx2") and not other.int_path_has_vnni()
    assert other.int_path_kind() == request.param  # avx2 or portable
    return other

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
    from minibatch.kernels.triton_support import cuda_device_unusable

    why = cuda_device_unusable()
    if why:
        pytest.skip(f"{why}; the Triton kernel tests need the GPU, not the interpreter", allow_module_level=True)


@pytest.fixture
def device() -> str:
    return DEVICE

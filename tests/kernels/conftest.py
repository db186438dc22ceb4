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


@pytest.fixture
def device() -> str:
    return DEVICE

"""Whether Triton can run here: compiled on a CUDA GPU, or in the interpreter (TRITON_INTERPRET=1) on CPU."""

from __future__ import annotations

import os


def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())

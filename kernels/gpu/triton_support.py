"""Whether Triton can run here: compiled on a CUDA GPU, or in the interpreter (TRITON_INTERPRET=1) on CPU."""

from __future__ import annotations

import glob
import os


def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# A launch option: each multiply and add rounded on its own, as the PyTorch twins compute (Triton fuses them into
# one by default when it compiles; the interpreter computes with NumPy, which never does, and drops the option).
NO_FUSED_MULTIPLY_ADD = {"enable_fp_fusion": False}


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cuda_device_unusable() -> str | None:
    """Why torch cannot use the NVIDIA GPU this machine has; None when there is none or torch can use it.

    Kernel tests must not "pass" in the interpreter on such a machine: they would
    prove nothing about the GPU.
    """
    if not glob.glob("/dev/nvidia[0-9]*"):
        return None
    import torch

    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"this machine has an NVIDIA GPU but torch {torch.__version__} is a CPU build"
    return (
        f"this machine has an NVIDIA GPU but torch {torch.__version__} (CUDA {torch.version.cuda}) cannot use it: "
        "the driver may be older than that CUDA version (see nvidia-smi)"
    )

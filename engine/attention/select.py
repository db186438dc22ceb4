"""Which attention backend and kernel set a device gets, and what the GPU kernels can run."""

from __future__ import annotations

import torch

from minibatch.engine.attention.torch_backend import TorchAttentionBackend
from minibatch.engine.attention.triton_backend import TritonAttentionBackend
from minibatch.engine.models.ops import CpuOps, TorchOps, TritonOps

# What the Triton kernels support, checked when the engine is built (never a failure mid-serving).
# Powers of two; past 128 a key tile no longer fits shared memory at head_dim 256.
GPU_BLOCK_SIZES = (8, 16, 32, 64, 128)
GPU_HEAD_DIMS = (16, 32, 64, 128, 256)  # tl.dot needs >= 16 and a power of two; 256 is the largest tile we size for


def gpu_shape_problems(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> list[str]:
    """Why the Triton path cannot run this model and block size (empty when it can)."""
    problems = []
    if block_size not in GPU_BLOCK_SIZES:
        problems.append(f"block_size {block_size} (the GPU kernels take {', '.join(map(str, GPU_BLOCK_SIZES))})")
    if head_dim not in GPU_HEAD_DIMS:
        problems.append(f"head_dim {head_dim} (the GPU kernels take {', '.join(map(str, GPU_HEAD_DIMS))})")
    if num_heads % num_kv_heads:
        problems.append(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    return problems


def select_backend(device: str, dtype: torch.dtype):
    """(attention backend, model ops): Triton on CUDA; on CPU, the C++ paged kernel for fp32 (else PyTorch)."""
    if device == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return TorchAttentionBackend(), TorchOps()
        return TritonAttentionBackend(), TritonOps()
    if dtype == torch.float32:
        from minibatch.kernels.cpu.paged_attention import load_extension, store_and_attention

        ext = load_extension()  # compiled on first use, then cached
        if ext is not None:
            return TorchAttentionBackend(store_and_attention), CpuOps(ext)
    return TorchAttentionBackend(), TorchOps()

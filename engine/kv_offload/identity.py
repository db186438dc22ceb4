"""What decides a KV block's contents besides its tokens: the disk tier's identity of a loaded model.

Two engines share blocks on disk only when every fact here is equal: the model's files (small ones by
content: config, tokenizer, a GGUF's preparation record with its SHA-256; weights by name, size and
modification time), how the weights run (native, native-exact, dequantised, the dtype, the device), the
KV cache's types, the block size, the rotary settings and which LongRoPE factors run, and the kernels
(their sources' digest and the build: native, avx2, portable). Any difference is another folder: a miss,
never a wrong block.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

from minibatch.engine.kv_offload.disk import FORMAT, identity_digest

SMALL_FILE = 1 << 20  # files up to this size are digested by content; larger ones by size and time


def model_files(model_dir: Path) -> dict[str, str]:
    """Each file of the model's folder: a digest of its contents (small) or its size and time (weights)."""
    out = {}
    for entry in sorted(os.scandir(model_dir), key=lambda e: e.name):
        if not entry.is_file():
            continue
        st = entry.stat()
        if st.st_size <= SMALL_FILE:
            with open(entry.path, "rb") as f:
                out[entry.name] = hashlib.blake2b(f.read(), digest_size=16).hexdigest()
        else:
            out[entry.name] = f"{st.st_size} bytes, modified {st.st_mtime_ns}"
    return out


def block_facts(
    model: str,
    model_dir: Path,
    weights: str,
    device: str,
    dtype: str,
    ops: str,
    kv_cache_type: str,
    block_size: int,
    rope: object,
    rope_factors: str | None,
) -> dict:
    """The facts a block's contents follow from (identity_digest of them names its folder)."""
    from minibatch.kernels.cpu.extension import build_name, sources_digest

    return {
        "format": FORMAT,
        "model": model,  # shown by `minibatchd prompt-cache`; the files below are what counts
        "files": model_files(Path(model_dir)),
        "weights": weights,
        "device": device,
        "dtype": dtype,
        "ops": ops,
        "kv_cache_type": kv_cache_type,
        "block_size": block_size,
        "rope": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(rope).items()},
        "rope_factors": rope_factors,
        "kernels": {"sources": sources_digest(), "build": build_name()},
    }


def identity_of(facts: dict) -> str:
    """The identity, leaving out what only names the model for a reader (two names of one file share)."""
    return identity_digest({k: v for k, v in facts.items() if k != "model"})

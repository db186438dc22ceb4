"""The CPU kernels' C++ extension: one module built from csrc/ on first use, then loaded from cache.

torch's extension builder keys its cache on the sources and flags, so a changed
source rebuilds once and every later start only loads the shared library.
Where it cannot be built (no compiler, no ninja) the PyTorch twins run and the
log says so once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("minibatch.kernels")
_CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    "module.cpp",
    "paged_attention.cpp",
    "quant_matmul.cpp",
    "quant_dot.cpp",
    "quant_pack.cpp",
    "cpu_ops.cpp",
    "lora.cpp",
    "sampling.cpp",
    "sampling_chain.cpp",
)
# No -ffast-math: the dequantisers must reproduce gguf.quants bit for bit.
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_ext = None
_tried = False


def sources_digest() -> str:
    """A digest of every file in csrc/ (torch's build cache hashes the sources, not the headers, so it goes
    into the flags; what the kernels compute is named by it, as the disk prompt cache's identity does)."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(_CSRC.iterdir()) if p.is_file())).hexdigest()[:16]


def build_name() -> str:
    """Which build of the kernels this process runs: native, or one of OTHER_BUILDS (MINIBATCH_CPU_BUILD)."""
    return os.environ.get(BUILD_VARIABLE, "native")


def describe() -> str:
    """What the CPU kernels run as, for /health: the build and the instructions of the integer dot products
    (avx512-vnni, avx-vnni, avx2 or portable), or that the PyTorch twins run instead."""
    ext = load_cpu_extension()
    if ext is None:
        return "PyTorch twins (the C++ kernels could not be built here)"
    return f"{build_name()} build; integer dot products on {ext.int_path_kind()}"


def load_cpu_extension():
    """The compiled extension, or None when it cannot be built here (then the PyTorch twins run)."""
    global _ext, _tried
    if _tried:
        return _ext
    _tried = True
    if os.environ.get("MINIBATCH_CPU_KERNELS", "1") == "0":
        log.info("CPU kernels disabled by MINIBATCH_CPU_KERNELS=0; using the PyTorch twins")
        return None
    build = build_name()
    if build != "native":
        if build not in OTHER_BUILDS:
            raise ValueError(f"{BUILD_VARIABLE}={build!r}: expected native or one of {sorted(OTHER_BUILDS)}")
        log.info("CPU kernels built for %s (%s), not for this CPU", build, BUILD_VARIABLE)
        _ext = load_other_build(build)
        return _ext
    _ext = _load_native()
    return _ext


def _load_native():
    """This CPU's build (compiled once, then imported from where it was built), or None."""
    started = time.perf_counter()
    digest = sources_digest()
    ext = _load_built(digest)
    if ext is not None:
        return ext
    try:
        from torch.utils.cpp_extension import load

        ext = load(
            name="minibatch_cpu_kernels",
            sources=[str(_CSRC / s) for s in SOURCES],
            extra_cflags=CFLAGS + [f"-DMINIBATCH_CSRC_DIGEST={digest}"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, unsupported platform: fall back
        log.warning("CPU kernels unavailable (%s: %s); using the PyTorch twins", type(exc).__name__, exc)
        return None
    took = time.perf_counter() - started
    if took > 2.0:
        log.info("compiled the CPU kernels in %.0f s (cached for later starts)", took)
    _remember_built(digest, ext)
    return ext


# The builds the tests make besides this CPU's, so that no path rots where this machine would not take it.
# MINIBATCH_CPU_BUILD=avx2 (or portable) makes the engine itself run on one: what such a CPU computes, here.
BUILD_VARIABLE = "MINIBATCH_CPU_BUILD"
OTHER_BUILDS = {
    "portable": ["-march=x86-64", "-DMINIBATCH_PORTABLE"],  # x86-64's baseline: the plain C++ loops
    "avx2": ["-march=haswell", "-DMINIBATCH_NO_VNNI"],  # AVX2 + FMA + F16C without VNNI dot products
}


def native_is(kind: str) -> bool:
    """This CPU's own build takes every path `kind`'s build takes: an AVX2 CPU with neither AVX-512 nor VNNI
    (its native build's dot products are AVX2's, its float kernels 256-bit), for `avx2`."""
    if kind != "avx2":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx2" in flags and "avx_vnni" not in flags and not any(x.startswith("avx512") for x in flags)


def load_other_build(kind: str):
    """The same sources built for another kind of CPU (OTHER_BUILDS), to test its paths here; on a CPU of that
    kind (native_is), its own build, which is that build's paths compiled for it (not compiled twice)."""
    if native_is(kind):
        ext = _load_native()
        if ext is not None:
            return ext
    from torch.utils.cpp_extension import load

    digest = sources_digest()
    return load(
        name=f"minibatch_cpu_kernels_{kind}",
        sources=[str(_CSRC / s) for s in SOURCES],
        extra_cflags=["-O3", "-fopenmp", *OTHER_BUILDS[kind], f"-DMINIBATCH_CSRC_DIGEST={digest}"],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


# torch's loader checks its build cache through setuptools and ninja (~0.2 s at every start); once a build
# exists for these sources, flags, torch and Python, the shared library is imported directly.
def _build_key(digest: str) -> str:
    import sys

    import torch

    return f"{digest} {' '.join(CFLAGS)} torch-{torch.__version__} py-{sys.version_info[0]}.{sys.version_info[1]}"


def _record() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("minibatch")) / "cpu-kernels.json"


def _load_built(digest: str):
    import importlib.machinery
    import importlib.util
    import json

    try:
        record = json.loads(_record().read_text())
        path = Path(record["path"]) if record.get("key") == _build_key(digest) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if path is None or not path.is_file():
        return None
    try:
        loader = importlib.machinery.ExtensionFileLoader(path.stem, str(path))
        spec = importlib.util.spec_from_file_location(path.stem, str(path), loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module
    except Exception as exc:  # a library that no longer loads: build through torch again
        log.info("rebuilding the CPU kernels: the cached build did not load (%s)", exc)
        return None


def _remember_built(digest: str, ext) -> None:
    import json

    try:
        _record().parent.mkdir(parents=True, exist_ok=True)
        tmp = _record().with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": _build_key(digest), "path": str(Path(ext.__file__).resolve())}))
        tmp.replace(_record())
    except OSError:
        pass

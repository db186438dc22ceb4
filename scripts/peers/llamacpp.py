"""llama.cpp's llama-server (what Ollama runs underneath), on the CPU.

The binary: --llama-server PATH, else $LLAMA_SERVER, else `llama-server` on
PATH. Build it from llama.cpp's sources as its own documentation says (CPU,
Release); this project ships and builds none of it. `llama-quantize` is looked
for beside it.

Model files (the source: the built-in model's GGUF, or bench.py's --model FILE), made once into
the peers cache dir:
  file  the source as it is (Q4_1 names it too, for the built-in Q4_1 file);
  F32   the same file with every tensor dequantised by gguf.quants (all metadata
        copied), so its weights equal ours exactly;
  Q8_0  llama-quantize's Q8_0 of the F32 file (gguf.quants' reference quantizer
        when llama-quantize is not there).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from . import Launch, peers_cache

VARIANTS = ("file", "Q4_1", "Q8_0", "F32")


def find_server(explicit: str | None = None) -> Path:
    for candidate in (explicit, os.environ.get("LLAMA_SERVER"), shutil.which("llama-server")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    raise SystemExit(
        "llama.cpp peer: no llama-server found: pass --llama-server PATH or set LLAMA_SERVER "
        "(build llama.cpp for the CPU as its README says)"
    )


def server_version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    return " ".join((out.stdout + out.stderr).split())[:200]


def command(binary: Path, model: Path, port: int, concurrency: int, threads: int, ctx_per_slot: int) -> list[str]:
    """llama-server for `concurrency` slots; its one KV buffer of -c tokens is split evenly between them."""
    slots = max(1, concurrency)
    return [
        str(binary),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-np",
        str(slots),
        "-c",
        str(slots * ctx_per_slot),
        "-cb",
        "--no-webui",
        "--log-disable",
    ]


def model_file(variant: str, source: Path, binary: Path | None, cache: Path | None = None) -> Path:
    """The GGUF for `variant`, made from the built-in Q4_1 file once."""
    if variant not in VARIANTS:
        raise SystemExit(f"llama.cpp peer: unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    if variant in ("file", "Q4_1"):
        return source
    cache = cache or peers_cache()
    cache.mkdir(parents=True, exist_ok=True)
    f32 = cache / f"{source.stem.replace('Q4_1', 'F32')}.gguf"
    if not f32.is_file():
        write_dequantised(source, f32)
    if variant == "F32":
        return f32
    q8 = cache / f"{source.stem.replace('Q4_1', 'Q8_0')}.gguf"
    if not q8.is_file():
        quantize = binary.parent / "llama-quantize" if binary is not None else None
        tmp = q8.with_suffix(".tmp")
        if quantize is not None and quantize.is_file():
            subprocess.run([str(quantize), str(f32), str(tmp), "Q8_0"], check=True, capture_output=True, timeout=1800)
        else:
            write_dequantised(source, tmp, requantize="Q8_0")
        tmp.rename(q8)
    return q8


def write_dequantised(source: Path, out: Path, requantize: str | None = None) -> None:
    """Copy `source` with every tensor dequantised to F32 (or requantized), all metadata kept."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
    from gguf.quants import dequantize, quantize

    reader = GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    tmp = out.with_suffix(".writing")
    writer = GGUFWriter(str(tmp), arch)
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, f.contents(), vtype, sub_type=sub)
    writer.add_file_type(LlamaFileType.ALL_F32 if requantize is None else LlamaFileType.MOSTLY_Q8_0)
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float32)  # [rows, K] in file order (nothing permuted)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        values = values.reshape(shape)
        if requantize and values.ndim == 2 and values.shape[-1] % 32 == 0:
            qt = GGMLQuantizationType[requantize]
            writer.add_tensor(t.name, quantize(values, qt), raw_shape=shape, raw_dtype=qt)
        else:
            writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)


def launch(
    variant: str, source: Path, port: int, concurrency: int, threads: int, ctx_per_slot: int, binary: str | None = None
) -> Launch:
    exe = find_server(binary)
    model = model_file(variant, source, exe)
    return Launch(
        name=f"llama.cpp {source.name if variant == 'file' else variant}",
        argv=command(exe, model, port, concurrency, threads, ctx_per_slot),
        url=f"http://127.0.0.1:{port}",
        info={"binary": str(exe), "version": server_version(exe), "model_file": str(model), "threads": threads},
    )

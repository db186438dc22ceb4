"""A small GGUF parser: the header, the metadata we need, and each tensor's bytes memory-mapped.

The `gguf` package's reader materialises every metadata value as numpy views,
the tokenizer's ~100k strings included: about 5 s for the built-in model. We
only need a few scalars and the tensor table, so arrays are skipped by their
lengths. Every read is bounds-checked, so a truncated or corrupt file gives one
clear error naming the file and what is wrong.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GGUF_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The file is not a well-formed GGUF file."""


@dataclass(slots=True, frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: innermost (contiguous) dimension first
    ggml_type: int
    offset: int  # from the start of the data section


class GGUFFile:
    """Metadata scalars (`metadata`), tensor infos (`tensors`) and `data(info, nbytes)` views."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with self.path.open("rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as exc:  # an empty file cannot be mapped
                raise GGUFFormatError(f"{self.path}: empty file") from exc
        self._pos = 0
        if self._take(4) != GGUF_MAGIC:
            raise GGUFFormatError(f"{self.path}: not a GGUF file (bad magic)")
        self.version = self._scalar("<I")
        if self.version not in (2, 3):
            raise GGUFFormatError(f"{self.path}: GGUF version {self.version} is not supported (2, 3)")
        n_tensors, n_kv = self._scalar("<Q"), self._scalar("<Q")
        self.metadata: dict[str, object] = {}
        self._arrays: dict[str, int] = {}  # key -> where its array starts, for array(key)
        for _ in range(n_kv):
            key = self._string()
            vtype = self._scalar("<I")
            if vtype == _ARRAY:
                self._arrays[key] = self._pos
            self.metadata[key] = self._value(vtype)
        self.tensors: list[TensorInfo] = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar("<I")
            if n_dims > 4:
                raise GGUFFormatError(f"{self.path}: tensor {name} has {n_dims} dimensions")
            dims = tuple(self._scalar("<Q") for _ in range(n_dims))
            self.tensors.append(TensorInfo(name, dims, self._scalar("<I"), self._scalar("<Q")))
        align = int(self.metadata.get("general.alignment", 32))
        self.data_start = -(-self._pos // align) * align

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def array(self, key: str) -> list[str] | np.ndarray | None:
        """A metadata array in full (strings as a list, numbers as a numpy array), or None when absent."""
        if key not in self._arrays:
            return None
        self._pos = self._arrays[key]
        etype, count = self._scalar("<I"), self._scalar("<Q")
        if etype in _SCALARS:
            dtype = np.dtype(_SCALARS[etype])
            return np.frombuffer(self._take(dtype.itemsize * count), dtype=dtype).copy()
        if etype == _STRING:
            out, pos, buf, size = [], self._pos, self._map, len(self._map)
            for _ in range(count):
                n = struct.unpack_from("<Q", buf, pos)[0] if pos + 8 <= size else size
                if pos + 8 + n > size:
                    raise GGUFFormatError(f"{self.path}: {key} runs past the end of the file (truncated)")
                out.append(buf[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace"))
                pos += 8 + n
            self._pos = pos
            return out
        raise GGUFFormatError(f"{self.path}: {key} is an array of type {etype}, not of numbers or strings")

    def data(self, info: TensorInfo, nbytes: int) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the mapped file."""
        start = self.data_start + info.offset
        if start + nbytes > len(self._map):
            raise GGUFFormatError(
                f"{self.path}: tensor {info.name} needs bytes {start}..{start + nbytes} but the file ends at "
                f"{len(self._map)} (truncated)"
            )
        return np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=start)

    # ---- parsing ----

    def _take(self, n: int) -> bytes:
        end = self._pos + n
        if end > len(self._map):
            raise GGUFFormatError(f"{self.path}: the header ends early at byte {len(self._map)} (truncated)")
        out = self._map[self._pos : end]
        self._pos = end
        return out

    def _scalar(self, fmt: str):
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        n = self._scalar("<Q")
        if n > len(self._map):
            raise GGUFFormatError(f"{self.path}: a string of {n} bytes at byte {self._pos} (corrupt header)")
        return self._take(n).decode("utf-8", errors="replace")

    def _value(self, vtype: int):
        if vtype in _SCALARS:
            return self._scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._scalar("<I"), self._scalar("<Q")
            if etype in _SCALARS:  # skipped: we need no numeric arrays
                self._take(struct.calcsize(_SCALARS[etype]) * count)
            elif etype == _STRING:
                pos, size = self._pos, len(self._map)
                for _ in range(count):
                    if pos + 8 > size:
                        break
                    pos += 8 + struct.unpack_from("<Q", self._map, pos)[0]
                if pos > size:
                    raise GGUFFormatError(f"{self.path}: a string array runs past the end of the file (truncated)")
                self._pos = pos
            else:
                for _ in range(count):
                    self._value(etype)
            return f"<array of {count}>"
        raise GGUFFormatError(f"{self.path}: unknown metadata value type {vtype} at byte {self._pos} (corrupt header)")

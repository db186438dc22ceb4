"""LoRA adapters' names: the option that names them and the prefix caches' namespace of a request under one
(no torch: the engine's options and core use these)."""

from __future__ import annotations

import hashlib
import math
import struct
from pathlib import Path

# the adapters a request runs under: (name, scale) pairs, by name, none of scale 0 (none at all: the base model)
LoraUses = tuple[tuple[str, float], ...]


def lora_uses(pairs) -> LoraUses:
    """(name, scale) pairs as a request's LoraUses: sorted by name, scale 0 dropped (it changes nothing), a name
    given twice or a scale that is not finite a ValueError."""
    out: dict[str, float] = {}
    for name, scale in pairs:
        if not math.isfinite(scale):
            raise ValueError(f"the scale of LoRA adapter {name!r} must be a finite number, got {scale}")
        if name in out:
            raise ValueError(f"LoRA adapter {name!r} is given twice")
        out[name] = float(scale)
    return tuple((n, s) for n, s in sorted(out.items()) if s != 0.0)


def lora_salt(salt: int, uses: list[tuple[bytes, float]]) -> int:
    """The namespace of a request of namespace `salt` under the adapters whose weights hash to these digests,
    with these scales (none: the base's, `salt` itself). An adapter changes every K and V after the first layer
    it touches, so its blocks are never a hit for another adapter, another scale or the base. Keyed by the
    weights, not the name: an adapter replaced under the same name is another."""
    if not uses:
        return salt
    h = hashlib.blake2b(salt.to_bytes(8, "little"), digest_size=8, person=b"minibatch-lsalt")
    for digest, scale in uses:
        h.update(digest + struct.pack("<d", scale))
    return int.from_bytes(h.digest(), "little")


def parse_loras(value: str | None) -> dict[str, str]:
    """--lora's NAME=PATH pairs, comma-separated (a PEFT folder each), as {name: path}; a ValueError naming the
    option and the pair at fault."""
    out: dict[str, str] = {}
    for item in (value or "").split(","):
        if not item.strip():
            continue
        name, eq, path = item.partition("=")
        name, path = name.strip(), path.strip()
        if not eq or not name or not path:
            raise ValueError(f"lora must be NAME=PATH pairs, comma-separated; got {item.strip()!r}")
        if name in out:
            raise ValueError(f"lora names adapter {name!r} twice")
        out[name] = path
    return out


def adapter_files(folder: str | Path) -> dict[str, Path]:
    """The adapters in `folder` by the names a request gives them: each PEFT folder (one holding
    adapter_config.json) by its name, each .gguf file by its name less the suffix. A name is only ever
    looked up in this listing, never joined to the folder's path."""
    out: dict[str, Path] = {}
    try:
        entries = sorted(Path(folder).iterdir())
    except OSError:
        return out
    for entry in entries:
        if entry.name.startswith("."):
            continue
        if entry.suffix == ".gguf" and entry.is_file():
            out.setdefault(entry.stem, entry)
        elif (entry / "adapter_config.json").is_file():
            out.setdefault(entry.name, entry)
    return out

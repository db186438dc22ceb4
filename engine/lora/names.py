"""LoRA adapters' names: the option that names them and the prefix caches' namespace of a request under one
(no torch: the engine's options and core use these)."""

from __future__ import annotations

import hashlib


def lora_salt(salt: int, digest: bytes | None) -> int:
    """The namespace of a request of namespace `salt` under the adapter whose weights hash to `digest` (None: the
    base's, `salt` itself). An adapter changes every K and V after the first layer it touches, so its blocks are
    never a hit for another adapter or the base. Keyed by the weights, not the name: an adapter replaced under
    the same name is another."""
    if digest is None:
        return salt
    h = hashlib.blake2b(salt.to_bytes(8, "little") + digest, digest_size=8, person=b"minibatch-lsalt")
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

"""Philox4x32-10 in NumPy: the twin of kernels/cpu/csrc/philox.h, and the sampler's draws where the C++ kernels
are not built (or on the GPU, whose twin draws with these uniforms too).

A draw is a pure function of (key, counter): the key is the request's seed, or the sampler's own key mixed
with the request id for an unseeded request; the counter is the position of the token drawn (the number of
output tokens before it). No generator object is kept per request, and a seeded request draws the same
uniform for its n-th token whatever else shares the batch, with or without speculation, after a restart.
"""

from __future__ import annotations

import numpy as np

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
_LOW = np.uint64(0xFFFFFFFF)
_32 = np.uint64(32)


def philox4x32_10(counter: np.ndarray, key: np.ndarray) -> np.ndarray:
    """counter uint32 [n, 4], key uint32 [n, 2] -> uint32 [n, 4]: the Random123 block function."""
    c = [counter[:, i].astype(np.uint64) for i in range(4)]
    k0, k1 = key[:, 0].astype(np.uint32), key[:, 1].astype(np.uint32)
    with np.errstate(over="ignore"):
        for r in range(10):
            if r:
                k0 = k0 + _W0
                k1 = k1 + _W1
            p0, p1 = _M0 * c[0], _M1 * c[2]
            c = [
                (p1 >> _32) ^ c[1] ^ k0.astype(np.uint64),
                p1 & _LOW,
                (p0 >> _32) ^ c[3] ^ k1.astype(np.uint64),
                p0 & _LOW,
            ]
    return np.stack(c, axis=1).astype(np.uint32)


def uniforms(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """int64 keys and counters [n] -> float64 [n] in [0, 1): 53 bits of the block at counter (pos, 0, 0, 0)."""
    return uniform_pairs(keys, counters)[0]


def uniform_pairs(keys: np.ndarray, counters: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The draw's uniform (`uniforms`, from the block's first two words) and a second, independent one from
    its last two (XTC's coin), for each (key, counter)."""
    k = np.asarray(keys, dtype=np.int64).view(np.uint64)
    n = np.asarray(counters, dtype=np.int64).view(np.uint64)
    ctr = np.zeros((len(k), 4), dtype=np.uint32)
    ctr[:, 0], ctr[:, 1] = n & _LOW, n >> _32
    key = np.stack([k & _LOW, k >> _32], axis=1).astype(np.uint32)
    out = philox4x32_10(ctr, key).astype(np.uint64)
    first = ((out[:, 0] << _32) | out[:, 1]) >> np.uint64(11)
    second = ((out[:, 2] << _32) | out[:, 3]) >> np.uint64(11)
    return first.astype(np.float64) * 2.0**-53, second.astype(np.float64) * 2.0**-53

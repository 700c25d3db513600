"""The numbers cgraw's random-number kernels draw, computed with NumPy: Philox4x32-10 and the
uniform floats of its words, the oracle the kernels are tested against (bitwise, on the GPU).

Layer L1 (pure): NumPy only. The counter layout is ``rng.kernels``'s: ``(group low, group high,
offset low, offset high)`` under the replay's key (``rng.plan.replay_key``).
"""

from __future__ import annotations

import numpy as np

_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85


def philox4x32_10(ctr, key) -> np.ndarray:
    """Philox4x32-10 on arrays: ``ctr`` is (..., 4) uint32, ``key`` (2,) ints; returns (..., 4)
    uint32. The reference the kernels are tested against (bitwise, on the GPU)."""
    c = np.array(ctr, dtype=np.uint64) & 0xFFFFFFFF
    c0, c1, c2, c3 = (c[..., i].copy() for i in range(4))
    k0, k1 = int(key[0]) & 0xFFFFFFFF, int(key[1]) & 0xFFFFFFFF
    m32 = np.uint64(0xFFFFFFFF)
    for i in range(10):
        if i:
            k0 = (k0 + _W0) & 0xFFFFFFFF
            k1 = (k1 + _W1) & 0xFFFFFFFF
        p0 = c0 * np.uint64(_M0)
        p1 = c2 * np.uint64(_M1)
        hi0, lo0 = p0 >> np.uint64(32), p0 & m32
        hi1, lo1 = p1 >> np.uint64(32), p1 & m32
        c0, c1, c2, c3 = hi1 ^ c1 ^ np.uint64(k0), lo1, hi0 ^ c3 ^ np.uint64(k1), lo0
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


def reference_words(key: int, offset: int, groups: int) -> np.ndarray:
    """The (groups, 4) words the kernels draw for groups ``0..groups-1`` at ``offset``."""
    g = np.arange(groups, dtype=np.uint64)
    ctr = np.stack([g & np.uint64(0xFFFFFFFF), g >> np.uint64(32),
                    np.full_like(g, offset & 0xFFFFFFFF), np.full_like(g, offset >> 32)], axis=-1)
    return philox4x32_10(ctr, (key & 0xFFFFFFFF, key >> 32))


def reference_uniform_f32(key: int, offset: int, n: int) -> np.ndarray:
    """``torch.rand(n)`` (float32, [0, 1)) as the kernel draws it at ``offset``."""
    w = reference_words(key, offset, -(-n // 4)).reshape(-1)[:n]
    return ((w >> 8).astype(np.float32) * np.float32(2.0 ** -24)).astype(np.float32)

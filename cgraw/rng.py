"""Graph-safe random numbers: seeds, per-graph streams and launch geometry (pure).

Layer L1 (pure): no CUDA, no framework. The kernels are in ``rng_kernels`` and run through
``rngexec``; torch and CuPy calls reach them through ``interop.torch_rng`` and
``interop.cupy_rng``.

Design (issue 11). Each graph that draws random numbers gets a 64-bit Philox key, derived from
``cgraw.manual_seed``'s seed and the graph's serial number since that call, and one 8-byte slot of
device memory holding its offset. A draw captured in the graph is a kernel that reads ``*slot``
and adds its own offset within the graph (``RngStream.take``); the graph's last node adds the
graph's total to ``*slot``. So every replay draws fresh numbers with no host work, the graph
needs no host-side state per replay, and the frameworks' own generators are never touched.
Two processes that seed cgraw alike and capture the same graphs in the same order draw the same
numbers.
"""

from __future__ import annotations

import threading

import numpy as np

DEFAULT_SEED = 0x853C49E6748FEA9B  # the seed until cgraw.manual_seed is called (fixed, like torch's)
BLOCK = 256
_MASK64 = (1 << 64) - 1

_lock = threading.Lock()
_state = {"seed": DEFAULT_SEED, "serial": 0}


def splitmix64(x: int) -> int:
    """SplitMix64's output function (Steele et al. 2014): a bijective 64-bit mix."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def manual_seed(seed: int) -> None:
    """Seed the random numbers of graphs captured from now on.

    Graphs captured after ``cgraw.manual_seed(s)`` draw the same numbers in every process that
    makes the same captures in the same order. torch's and CuPy's own generators are unaffected
    (seed them as usual for eager code)."""
    seed = int(seed)
    if seed < 0:
        seed &= _MASK64
    if seed >> 64:
        raise ValueError("cgraw.manual_seed takes a seed in [0, 2**64)")
    with _lock:
        _state["seed"] = seed
        _state["serial"] = 0


def initial_seed() -> int:
    """The seed set by the last ``cgraw.manual_seed`` (or the default)."""
    return _state["seed"]


def next_key() -> int:
    """The Philox key of the next graph that draws random numbers."""
    with _lock:
        serial = _state["serial"]
        _state["serial"] = serial + 1
        seed = _state["seed"]
    return splitmix64(splitmix64(seed) ^ splitmix64(serial + 0x5851F42D4C957F2D))


class RngStream:
    """The random numbers of one capture: its key, its offset slot, and the draws so far.

    ``key`` is assigned on the first draw (a capture that draws nothing takes no serial number,
    so unrelated captures do not shift the streams of later ones)."""

    __slots__ = ("slot", "key", "calls", "device", "thread")

    def __init__(self, slot: int, device: int, thread: int):
        self.slot = slot
        self.key: int | None = None
        self.calls = 0
        self.device = device
        self.thread = thread

    def take(self, steps: int = 1) -> tuple[int, int]:
        """``(key, offset within the graph)`` for a draw using ``steps`` counter offsets."""
        if self.key is None:
            self.key = next_key()
        off = self.calls
        self.calls = off + steps
        return self.key, off


def grid(n: int, per_group: int, sm_count: int) -> int:
    """Blocks for ``n`` outputs at ``per_group`` per thread-iteration (grid-stride loop: the
    numbers do not depend on it)."""
    groups = -(-n // per_group)
    return max(1, min(-(-groups // BLOCK), sm_count * 8))


# ----------------------------------------------------------------------------- reference (numpy)

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


# ----------------------------------------------------------------------------- argument rules

# significand bits of the float dtypes: torch's random_() on a float tensor draws [0, 2**digits]
_DIGITS = {"f32": 24, "f64": 53, "f16": 11, "bf16": 8}
_INT_MAX = {"i8": 127, "u8": 255, "i16": 32767, "i32": 2**31 - 1, "i64": 2**63 - 1, "b8": 1}


def random_range(dtype: str, low: int | None = None, high: int | None = None) -> tuple[int, int]:
    """``(lo, range)`` of ``Tensor.random_`` (and ``randint``) for a dtype code: ``[low, high)``;
    a missing ``high`` is the dtype's top (inclusive, as torch does); no arguments is
    ``[0, top]``."""
    top = 2 ** _DIGITS[dtype] if dtype in _DIGITS else _INT_MAX[dtype]
    lo = 0 if low is None else int(low)
    hi = top + 1 if high is None else int(high)
    if hi <= lo:
        raise ValueError(f"random_ expects 'from' < 'to', got from={lo} >= to={hi}")
    return lo, hi - lo


def is_wide(dist: str, dtype: str, rng_range: int = 0) -> bool:
    """Whether a draw needs 64 random bits per value: float64 continuous values, integer
    ranges wider than 2**32, and every Poisson and binomial draw."""
    if dist == "randint":
        return rng_range > 2**32
    if dist in ("bernoulli", "bernoulli_t"):
        return False
    if dist in ("poisson", "binomial"):
        return True  # 52-bit uniforms whatever the integer dtype
    return dtype == "f64"

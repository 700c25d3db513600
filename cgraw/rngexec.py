"""Graph-safe random numbers on the device: offset slots and kernel launches.

Layer L3 (a backend over ``_cuda``): knows nothing of torch or CuPy; callers pass raw addresses,
element counts and dtype codes (``rng_kernels.CTYPES``). The pure decisions are in ``rng``.

Slots. A graph's offset lives in an 8-byte slot of a per-device arena (``cuMemAlloc`` of
``SLOTS`` slots, made outside any capture and kept for the process: a graph's kernels hold its
address). ``reserve`` (before a capture begins) takes one and zeroes it (waiting for the zeroing);
``SlotHolder`` (kept by the graph) gives it back when the graph is gone. Reuse is safe: a reused
slot is zeroed again, and the next graph has another key.
"""

from __future__ import annotations

import threading

from cgraw import _cuda, rng
from cgraw import rng_kernels as K
from cgraw._cuda import kernels as _k

SLOTS = 4096
_lock = threading.Lock()
_free: dict[int, list[int]] = {}  # device ordinal -> free slot addresses
_arenas: dict[int, list[int]] = {}
_sms: dict[int, int] = {}

_FILL_TYPES = (_k.ARG_PTR, _k.ARG_I64, _k.ARG_PTR, _k.ARG_U64, _k.ARG_U64, _k.ARG_F64, _k.ARG_F64,
               _k.ARG_PTR, _k.ARG_I64, _k.ARG_U64)
_DROPOUT_TYPES = (_k.ARG_PTR, _k.ARG_PTR, _k.ARG_PTR, _k.ARG_I64, _k.ARG_PTR, _k.ARG_U64, _k.ARG_U64,
                  _k.ARG_F32, _k.ARG_F32)
_ADVANCE_TYPES = (_k.ARG_PTR, _k.ARG_U64)


def reserve(device: int, stream) -> int:
    """A zeroed offset slot on ``device`` (zeroed on ``stream``, which is synchronised: call it
    before that stream waits on other work). Outside captures."""
    with _lock:
        free = _free.setdefault(device, [])
        if not free:
            base = _cuda.mem_alloc(SLOTS * 8)
            _arenas.setdefault(device, []).append(base)
            free.extend(base + 8 * i for i in range(SLOTS - 1, -1, -1))
        slot = free.pop()
    try:
        # zeroed before any replay: a replay runs on the caller's stream, not this one
        _k.memset_d32_async(slot, 0, 2, stream)
        _cuda.stream_synchronize(stream)
    except BaseException:
        release(device, slot)
        raise
    return slot


def release(device: int, slot: int) -> None:
    """Give a slot back (host bookkeeping only; never raises)."""
    try:
        with _lock:
            _free.setdefault(device, []).append(slot)
    except Exception:
        pass


class SlotHolder:
    """Kept by a graph that draws random numbers: returns its slot when the graph is gone."""

    __slots__ = ("device", "slot", "key", "draws")

    def __init__(self, stream: rng.RngStream):
        self.device, self.slot, self.key, self.draws = stream.device, stream.slot, stream.key, stream.calls

    def __repr__(self) -> str:
        return f"<cgraw graph random numbers: key 0x{self.key:016x}, {self.draws} draw(s) per replay>"

    def __del__(self):
        release(self.device, self.slot)


def _sm_count(device: int) -> int:
    n = _sms.get(device)
    if n is None:
        n = _sms[device] = _k.multiprocessor_count(device)
    return n


def fill(stream: rng.RngStream, dist: str, dtype: str, out: int, n: int, cu_stream, *, a: float = 0.0,
         b: float = 0.0, p: int = 0, lo: int = 0, rng_range: int = 0, wide: bool = False) -> None:
    """Write ``n`` draws of ``dist`` into the contiguous array at ``out`` (dtype code ``dtype``),
    on ``cu_stream`` (the capture stream or a side stream of it). A rejection sampler
    (``rng_kernels.SAMPLERS``) runs one thread per element, each on its own counter stream, and
    takes ``SAMPLER_STEPS[dist]`` offsets; the others draw 4 (2 when wide) values per group."""
    if n <= 0:
        return
    steps = K.SAMPLER_STEPS.get(dist)
    if steps is not None and n >= K.SAMPLE_MAX:
        raise ValueError(f"cgraw draws at most {K.SAMPLE_MAX - 1} {dist} samples per call, not {n}")
    func = _k.function(stream.device, K.fill_name(dist, dtype, wide), K.source)
    key, call = stream.take(steps or 1)
    g = rng.grid(n, 1 if steps else 2 if wide else 4, _sm_count(stream.device))
    _k.launch(func, g, rng.BLOCK, (out, n, stream.slot, key, call, float(a), float(b), p, int(lo),
                                   int(rng_range) & ((1 << 64) - 1)), _FILL_TYPES, cu_stream)


def sample(stream: rng.RngStream, dist: str, dtype: str, out: int, n: int, cu_stream, a: float, b: float = 0.0,
           *, wide: bool = False) -> None:
    """``fill`` of a rejection sampler with its two parameters."""
    fill(stream, dist, dtype, out, n, cu_stream, a=a, b=b, wide=wide)


def dropout(stream: rng.RngStream, dtype: str, src: int, out: int, mask: int, n: int, keep: float,
            scale: float, cu_stream) -> None:
    """``out = src * scale`` where kept (probability ``keep``), else 0; ``mask`` (bool, may be 0)."""
    if n <= 0:
        return
    func = _k.function(stream.device, K.dropout_name(dtype), K.source)
    key, call = stream.take(1)
    g = rng.grid(n, 4, _sm_count(stream.device))
    _k.launch(func, g, rng.BLOCK, (src, out, mask, n, stream.slot, key, call, float(keep), float(scale)),
              _DROPOUT_TYPES, cu_stream)


def advance(stream: rng.RngStream, cu_stream) -> None:
    """The graph's last node: ``*slot += draws``, so the next replay draws fresh numbers."""
    func = _k.function(stream.device, K.ADVANCE_NAME, K.source)
    _k.launch(func, 1, 1, (stream.slot, stream.calls), _ADVANCE_TYPES, cu_stream)


def read_offset(device: int, slot: int) -> int:
    """The slot's current value (synchronous; for tests and ``Graph.rng_offset``)."""
    import ctypes

    buf = ctypes.c_uint64(0)
    _cuda.ctx_synchronize()
    _cuda.memcpy_dtoh(ctypes.addressof(buf), slot, 8)
    return int(buf.value)


def arenas() -> list[tuple[int, int]]:
    """``(base, bytes)`` of every offset arena."""
    with _lock:
        return [(b, SLOTS * 8) for bases in _arenas.values() for b in bases]


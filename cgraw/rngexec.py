"""Graph-safe random numbers on the device: generator records and kernel launches.

Layer L3 (a backend over ``_cuda``): knows nothing of torch or CuPy; callers pass raw addresses,
element counts and dtype codes (``rng_kernels.CTYPES``). The pure decisions (keys, the host's
mirror, the per-replay step) are in ``rng``.

Records. Per device, one ``cuMemAlloc`` (made outside any capture, kept for the process: the
kernels of live graphs hold its addresses) holds one 32-byte generator record per framework
(``rng.KINDS``). ``source(device, kind, stream)`` (before a capture begins) makes the device's
records on first use, zeroed; the host's mirror starts unknown, so the first replay writes its
record (``rng.Source.set``: the ``cgraw_rng_set`` kernel on the replay's stream).
"""

from __future__ import annotations

import threading

from cgraw import _cuda, rng
from cgraw import rng_kernels as K
from cgraw._cuda import kernels as _k
from cgraw.device import Device

_lock = threading.Lock()
_sources: dict[tuple[int, str], rng.Source] = {}  # (device ordinal, kind) -> its record
_arenas: dict[int, int] = {}  # device ordinal -> base of its records
_sms: dict[int, int] = {}

_FILL_TYPES = (_k.ARG_PTR, _k.ARG_I64, _k.ARG_PTR, _k.ARG_U64, _k.ARG_F64, _k.ARG_F64, _k.ARG_PTR, _k.ARG_I64,
               _k.ARG_U64)
_DROPOUT_TYPES = (_k.ARG_PTR, _k.ARG_PTR, _k.ARG_PTR, _k.ARG_I64, _k.ARG_PTR, _k.ARG_U64, _k.ARG_F32, _k.ARG_F32)
_ADVANCE_TYPES = (_k.ARG_PTR, _k.ARG_U64, _k.ARG_U64)
_SET_TYPES = (_k.ARG_PTR, _k.ARG_U64, _k.ARG_U64)


def source(device: int, kind: str, stream) -> rng.Source:
    """The generator record of framework ``kind`` on ``device``; the first call for a device
    allocates and zeroes its records on ``stream`` and waits for it. Outside captures."""
    src = _sources.get((device, kind))
    if src is not None:
        return src
    with _lock:
        src = _sources.get((device, kind))
        if src is not None:
            return src
        base = _arenas.get(device)
        if base is None:
            nbytes = rng.SOURCE_BYTES * len(rng.KINDS)
            base = _cuda.mem_alloc(nbytes)
            try:
                _k.memset_d32_async(base, 0, nbytes // 4, stream)
                _cuda.stream_synchronize(stream)
            except BaseException:
                _cuda.mem_free(base)
                raise
            _arenas[device] = base
        slot = base + rng.SOURCE_BYTES * rng.KINDS.index(kind)
        src = _sources[(device, kind)] = rng.Source(kind, device, slot, _writer(device, slot))
        return src


def _writer(device: int, slot: int):
    """``write(stream, base, pos)`` of a record: one ``cgraw_rng_set`` launch on ``stream`` (an
    address), in the device's context (a replay may find another device's current)."""
    ctx = Device(device).context

    def write(stream, base: int, pos: int) -> None:
        cur = _cuda.ctx_get_current()
        switch = _cuda.native(cur) != _cuda.native(ctx)
        if switch:
            _cuda.ctx_set_current(ctx)
        try:
            func = _k.function(device, K.SET_NAME, K.source)
            _k.launch(func, 1, 1, (slot, base, pos), _SET_TYPES, _cuda.stream_handle(stream))
        finally:
            if switch:
                _cuda.ctx_set_current(cur)

    return write


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
    call = stream.take(steps or 1, n)
    g = rng.grid(n, 1 if steps else 2 if wide else 4, _sm_count(stream.device))
    _k.launch(func, g, rng.BLOCK, (out, n, stream.slot, call, float(a), float(b), p, int(lo),
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
    call = stream.take(1, n)
    g = rng.grid(n, 4, _sm_count(stream.device))
    _k.launch(func, g, rng.BLOCK, (src, out, mask, n, stream.slot, call, float(keep), float(scale)),
              _DROPOUT_TYPES, cu_stream)


def advance(stream: rng.RngStream, cu_stream) -> None:
    """The graph's last node: the record moves by the replay's increment, so the next replay draws
    fresh numbers."""
    func = _k.function(stream.device, K.ADVANCE_NAME, K.source)
    _k.launch(func, 1, 1, (stream.slot, stream.increment, int(stream.kind == rng.CUPY)), _ADVANCE_TYPES,
              cu_stream)


def read_record(device: int, slot: int) -> tuple[int, int, int]:
    """``(key, pos, base)`` a record holds now (synchronous; for tests)."""
    import ctypes

    buf = (ctypes.c_uint64 * 3)()
    _cuda.ctx_synchronize()
    _cuda.memcpy_dtoh(ctypes.addressof(buf), slot, 24)
    return int(buf[0]), int(buf[1]), int(buf[2])


def arenas() -> list[tuple[int, int]]:
    """``(base, bytes)`` of every device's generator records."""
    with _lock:
        return [(b, rng.SOURCE_BYTES * len(rng.KINDS)) for b in _arenas.values()]

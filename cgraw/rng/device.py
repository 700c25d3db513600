"""Graph-safe random numbers on the device: generator records and kernel launches.

Layer L3 (a backend over ``_cuda``): knows nothing of torch or CuPy; callers pass raw addresses,
element counts and dtype codes (``rng.kernels.CTYPES``). The pure decisions (keys, the host's
mirror, the per-replay step) are in ``rng``.

Records. One 32-byte generator record per device, framework (``rng.plan.KINDS``) and capturing
thread: the graphs a thread captures read its record, so threads replaying side by side never
share one. Records come from per-device arenas of ``RECORDS`` (``cuMemAlloc``, made outside any
capture, zeroed, kept for the process: the kernels of live graphs hold their addresses).
``source(device, kind, stream, thread)`` (before a capture begins) hands out the thread's record;
the host's mirror starts unknown, so the first replay writes it (``rng.plan.Source.set``: the
``cgraw_rng_set`` kernel on the replay's stream).
"""

from __future__ import annotations

import threading

from cgraw import _cuda
from cgraw.rng import plan as rng, kernels as K
from cgraw._cuda import kernels as _k
from cgraw.runtime.device import Device

RECORDS = 32  # records per arena
_lock = threading.Lock()
_sources: dict[tuple[int, str, int], rng.Source] = {}  # (device, kind, thread) -> its record; under _lock
_arenas: dict[int, list[int]] = {}  # device ordinal -> bases of its arenas; under _lock
_taken: dict[int, int] = {}  # device ordinal -> records handed out; under _lock
_sms: dict[int, int] = {}

_FILL_TYPES = (_k.ARG_PTR, _k.ARG_I64, _k.ARG_PTR, _k.ARG_U64, _k.ARG_F64, _k.ARG_F64, _k.ARG_PTR, _k.ARG_I64,
               _k.ARG_U64)
_DROPOUT_TYPES = (_k.ARG_PTR, _k.ARG_PTR, _k.ARG_PTR, _k.ARG_I64, _k.ARG_PTR, _k.ARG_U64, _k.ARG_F32, _k.ARG_F32)
_ADVANCE_TYPES = (_k.ARG_PTR, _k.ARG_U64, _k.ARG_U64)
_SET_TYPES = (_k.ARG_PTR, _k.ARG_U64, _k.ARG_U64)
_STEP_TYPES = (_k.ARG_PTR,)


def source(device: int, kind: str, stream, thread: int) -> rng.Source:
    """The generator record of framework ``kind`` on ``device`` for graphs captured on ``thread``;
    a new arena is allocated and zeroed on ``stream`` (waited for) when the device's are taken.
    Outside captures."""
    key = (device, kind, thread)
    src = _sources.get(key)
    if src is not None:
        return src
    with _lock:
        src = _sources.get(key)
        if src is not None:
            return src
        n = _taken.get(device, 0)
        bases = _arenas.setdefault(device, [])
        if n == len(bases) * RECORDS:
            nbytes = rng.SOURCE_BYTES * RECORDS
            base = _cuda.mem_alloc(nbytes)
            try:
                _k.memset_d32_async(base, 0, nbytes // 4, stream)
                _cuda.stream_synchronize(stream)
            except BaseException:
                _cuda.mem_free(base)
                raise
            bases.append(base)
        slot = bases[n // RECORDS] + rng.SOURCE_BYTES * (n % RECORDS)
        _taken[device] = n + 1
        src = _sources[key] = rng.Source(kind, device, slot, _writer(device, slot))
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
    (``rng.kernels.SAMPLERS``) runs one thread per element, each on its own counter stream, and
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


class WarmUp:
    """What a graphed function's warm-up enters to draw with cgraw's kernels: a framework's router
    over a ``rng.plan.WarmStream`` (``_router``), the warm-up's side of the generator (``_warm``:
    ``rng.plan.TorchWarm`` or ``RkWarm``) and the stream it draws on (``_cu``). On exit the record
    moves as a replay's last node moves it, then the host's mirror (``warm.end``); a launch that
    fails leaves the record unknown, and the next replay writes it."""

    __slots__ = ("_cu", "_router", "_warm")

    def __enter__(self):
        self._router.enter()
        _warming.__dict__.setdefault("active", []).append(self)
        return self

    def __exit__(self, *exc) -> bool:
        _warming.active.remove(self)
        self._router.exit()
        stream = self._router.stream
        if stream.calls:
            try:
                advance(stream, self._cu)
            except BaseException:
                self._warm.source.forget()
                raise
            self._warm.end(stream.increment)
        return False


_warming = threading.local()  # .active: the WarmUps entered on this thread


def warming() -> bool:
    """Whether a warm-up that draws with cgraw's kernels is under way on this thread."""
    return bool(getattr(_warming, "active", ()))


def loop_draws() -> list:
    """A ``rng.plan.LoopDraws`` per warm-up drawing on this thread (none outside warm-ups): what
    ``cgraw.while_loop``'s host path keeps, so that its draws are those of the device's loop."""
    return [rng.LoopDraws(w._router.stream, lambda s, cu=w._cu: step_key(s, cu))
            for w in getattr(_warming, "active", ())]


def step_key(stream: rng.RngStream, cu_stream) -> None:
    """A ``cgraw.while_loop`` body's last node when the body draws: the record's key moves on
    (``rng.plan.loop_key``), so the next iteration's draws are fresh."""
    func = _k.function(stream.device, K.STEP_NAME, K.source)
    _k.launch(func, 1, 1, (stream.slot,), _STEP_TYPES, cu_stream)


def read_record(device: int, slot: int) -> tuple[int, int, int]:
    """``(key, pos, base)`` a record holds now (synchronous; for tests)."""
    import ctypes

    buf = (ctypes.c_uint64 * 3)()
    _cuda.ctx_synchronize()
    _cuda.memcpy_dtoh(ctypes.addressof(buf), slot, 24)
    return int(buf[0]), int(buf[1]), int(buf[2])


def arenas() -> list[tuple[int, int]]:
    """``(base, bytes)`` of every arena of generator records."""
    with _lock:
        return [(b, rng.SOURCE_BYTES * RECORDS) for bases in _arenas.values() for b in bases]


class RngAdapter:
    """A random-number router in a capture's adapter list (``runtime.capture``; no streams of its own)."""

    __slots__ = ("router",)

    def __init__(self, router):
        self.router = router

    def producer_streams(self) -> list[int]:
        return []

    def enter(self) -> None:
        self.router.enter()

    def exit(self, failed: bool = False) -> None:
        self.router.exit()

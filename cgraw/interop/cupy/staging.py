"""Host-to-device uploads inside a capture: CuPy's ``cupy._core.array`` staged through a cgraw arena.

Layer L7. CuPy 14.2 refuses every host-to-device copy on a capturing stream, whatever memory it
comes from: ``cupy.asarray(numpy_array)`` inside a capture ends in ``cupy._core.core._array_default``
-> ``MemoryPointer``'s host copy (``cupy/cuda/memory.pyx:619``), which raises ``RuntimeError: the
current stream is capturing, so H2D transfers are disallowed`` (seen on the H200 with CuPy 14.2).
That method is Cython (cdef/cpdef) and cannot be patched, and the refusal comes after CuPy's pinned
allocation, so no pinned allocator can make the copy capturable. cgraw therefore intercepts one
step earlier, at the Python-visible entry: ``cupy.asarray``, ``cupy.array`` and ``cupy.asanyarray``
(``cupy/_creation/from_data.py``), and ``cupy/_math`` helpers, call ``_core.array(obj, dtype, copy,
order, subok, ndmin, blocking)`` looked up on the module ``cupy._core`` at call time. cupyx's
``ndimage`` and ``signal`` upload their constants (filter weights, zoom and spline coefficients,
windows) with ``cupy.asarray(numpy_array)`` / ``cupy.array([...], dtype=...)``, so they go the same
way. (``cupy.ascontiguousarray`` calls ``_core.ascontiguousarray``, which takes only CuPy arrays.)

While a capture routes CuPy, ``cupy._core.array`` is a wrapper (``install``: a process-global
attribute, set by the first such capture; ``uninstall``: the last one puts the function that was
there back, unless something else replaced the wrapper meanwhile, which then stays). On the
capturing thread, inside the capture proper, with CuPy's current stream being cgraw's capture
stream, the wrapper takes host data itself: a NumPy array, a Python or NumPy scalar, or a
(nested) list or tuple of those, that NumPy converts to a dtype CuPy supports. Like CuPy it
converts with NumPy honouring ``dtype`` and ``ndmin``, makes the result little-endian, picks the
memory order (F when ``order`` is ``'F'``, or is ``'A'``/``'K'`` and the NumPy array is
F-contiguous and not C-contiguous; otherwise C) and allocates the result with ``cupy.empty`` (from
cgraw's pool). It then writes the bytes into a block of the pinned arena owned by the graph being
captured, and enqueues ``cuMemcpyHtoDAsync`` from that block on the capture stream
(``_cuda.memcpy_htod_async``). The graph holds a memcpy node from pinned memory it owns, so every
replay uploads the values of the recording. A 0-byte array takes no block and no copy. With
``blocking=True`` the copy is still an asynchronous node of the graph (nothing can wait on the
host inside a capture). On every other thread, outside the capture proper, on another stream,
and for CuPy arrays, objects with ``__cuda_array_interface__`` or ``__cupy_get_ndarray__`` or a
device ``__dlpack_device__``, ``subok=True``, an unknown ``order``, or data NumPy cannot convert to
a CuPy dtype, the wrapper calls the original function unchanged (inside a capture CuPy then
refuses as before, and cgraw names the upload).

CuPy's pinned memory path is no longer reached on the capturing thread, so nothing of it is
replaced: no pinned allocator, no ``Event.done``, no ``record`` hook on the capture stream (they
served CuPy's own staging, which CuPy 14.2 refuses before the copy whatever the allocator). Other
threads keep CuPy's own uploads.

The arena is one ``cuMemHostAlloc`` segment of ``CGRAW_PINNED_STAGING_BYTES`` (default 16 MiB; 0
turns staging off), reserved before a capture begins and only while no capture routes
allocations. A staged block is never reused while its graph lives. When the graph is closed or
collected its blocks wait until the devices have been synchronised (before a later capture, while
none runs) and are then reused. Refused, with a ``CaptureError`` naming the CuPy call and the fix
(make the device array before the capture): an upload the arena cannot hold, and any upload with
staging off or unavailable.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import weakref

import numpy

import allocator
from cgraw import _cuda
from cgraw._cuda import defer
from cgraw.errors import CaptureError

DEFAULT_BYTES = 16 << 20
ROUND = 512  # CuPy's pinned pool rounds to 512 bytes too
CUPY_TYPES = "?bhilqBHILQefdFD"  # the dtype characters CuPy 14 supports (cupy/_core/_dtype.pyx)
_ORDERS = ("C", "F", "A", "K")
_DL_HOST = (1, 3)  # DLPack kDLCPU, kDLCUDAHost


def staging_bytes() -> int:
    """``CGRAW_PINNED_STAGING_BYTES`` (bytes; a ``k``/``m``/``g`` suffix is allowed), rounded up to 512."""
    raw = os.environ.get("CGRAW_PINNED_STAGING_BYTES", "").strip().lower()
    if not raw:
        return DEFAULT_BYTES
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(raw[-1], 1)
    try:
        n = int(float(raw[:-1] if scale > 1 else raw) * scale)
    except ValueError:
        raise ValueError(f"CGRAW_PINNED_STAGING_BYTES={raw!r} must be a number of bytes (k, m, g allowed)") from None
    return max(0, -(-n // ROUND) * ROUND)


class HostSource:
    """``allocator.SegmentSource`` over ``cuMemHostAlloc``. ``reserve`` refuses while any capture
    routes allocations (another thread's global capture would be invalidated by the call)."""

    def __init__(self, alloc=None, free=None):
        self._alloc = alloc or _cuda.mem_host_alloc
        self._free = free or _cuda.mem_free_host
        self.segments: dict[int, int] = {}

    def reserve(self, nbytes: int) -> int:
        if defer.active():
            raise MemoryError("the pinned staging arena grows only while no capture routes allocations")
        ptr = self._alloc(nbytes)
        self.segments[ptr] = nbytes
        return ptr

    def release(self, addr: int, nbytes: int) -> None:
        del self.segments[addr]
        defer.release(self._free, addr)


class PinnedArena:
    """Pinned host blocks for uploads inside captures: an ``allocator.Pool`` of one segment.

    ``grow()`` reserves the segment (outside captures); ``take`` hands out a block or raises
    ``PoolExhausted``; ``retire`` returns a dead graph's blocks to quarantine, and ``drain(sync)``
    makes them reusable after ``sync(devices)`` has waited for every replay that may read them.
    """

    def __init__(self, capacity: int, source=None):
        self.capacity = capacity
        self.source = source if source is not None else HostSource()
        seg = max(capacity, ROUND)
        self.pool = allocator.Pool(self.source, limit=capacity, round_to=ROUND, small_segment=seg,
                                   segment_round=seg, small_threshold=seg, name="pinned staging")
        self._lock = threading.Lock()
        self._quarantine: list[tuple[int, list[int]]] = []  # (device ordinal, block addresses); under _lock

    @property
    def ready(self) -> bool:
        return bool(self.pool.segment_ranges())

    def grow(self) -> None:
        """Reserve the segment now if it is not held (call only while no capture routes allocations)."""
        if self.capacity and not self.ready:
            self.pool.free(self.pool.malloc(self.capacity))

    def take(self, nbytes: int) -> int:
        return self.pool.malloc(max(int(nbytes), 1)).ptr

    def give_back(self, ptrs) -> None:
        """Blocks that never reached a replay (a failed capture): reusable at once."""
        for p in ptrs:
            self.pool.free(p)

    def retire(self, device: int, ptrs: list[int]) -> None:
        """A graph is gone: its blocks wait for the device to finish its replays. Never raises."""
        if ptrs:
            with self._lock:
                self._quarantine.append((device, list(ptrs)))

    def quarantined(self) -> int:
        with self._lock:
            return sum(len(p) for _, p in self._quarantine)

    def drain(self, sync) -> int:
        """``sync(devices)`` then make every quarantined block reusable; returns how many."""
        with self._lock:
            batch, self._quarantine = self._quarantine, []
        if not batch:
            return 0
        try:
            sync(sorted({d for d, _ in batch}))
        except BaseException:
            with self._lock:
                self._quarantine[:0] = batch
            raise
        n = 0
        for _, ptrs in batch:
            self.give_back(ptrs)
            n += len(ptrs)
        return n

    def stats(self):
        return self.pool.stats()


class StagedUploads:
    """The staged blocks of one graph: kept in ``Graph._keepalive``; when the graph is closed or
    collected they go to the arena's quarantine (a finalizer: it never refers to the graph)."""

    __slots__ = ("ptrs", "calls", "_finalizer", "__weakref__")

    def __init__(self, arena: PinnedArena, device: int, ptrs: list[int], calls: list[str]):
        self.ptrs = list(ptrs)
        self.calls = list(calls)
        self._finalizer = weakref.finalize(self, arena.retire, device, self.ptrs)


# ---------------------------------------------------------------- the per-capture side

_tls = threading.local()  # .staging: this thread's CaptureStaging while its capture routes CuPy


class CaptureStaging:
    """One capture's uploads: blocks taken from the arena, the CuPy calls that made them, and the
    capture stream (a cgraw ``Stream``) their copies go to."""

    def __init__(self, arena: PinnedArena | None, device: int, unavailable: str = "", stream=None):
        self.arena = arena
        self.device = device
        self.unavailable = unavailable  # why staging cannot serve this capture, or ""
        self.stream = stream
        self.ptrs: list[int] = []
        self.calls: list[str] = []

    def allocate(self, size: int, call: str) -> int:
        if self.arena is None or not self.arena.ready:
            raise _refusal(call, size, self.unavailable or "the pinned staging arena is not allocated",
                           "set CGRAW_PINNED_STAGING_BYTES above 0, or make the device array before the capture")
        try:
            ptr = self.arena.take(size)
        except allocator.PoolExhausted as exc:
            st = self.arena.stats()
            raise _refusal(call, size, f"the pinned staging arena ({self.arena.capacity} bytes, {st.allocated_bytes} "
                           f"held by live graphs and this capture, largest free block {st.largest_free_block}) "
                           f"cannot hold it",
                           "raise CGRAW_PINNED_STAGING_BYTES, close graphs you no longer replay, or make the "
                           "device array before the capture") from exc
        self.ptrs.append(ptr)
        self.calls.append(call)
        return ptr

    def upload(self, cupy, host: numpy.ndarray, order: str, call: str):
        """``host`` as a new CuPy array in ``order``: its bytes written into a block of the arena,
        copied to the device by a node of the graph being captured."""
        dtype = host.dtype.newbyteorder("<")  # CUDA devices are little-endian; CuPy swaps too
        nbytes = host.size * dtype.itemsize
        ptr = self.allocate(nbytes, call) if nbytes else 0
        out = cupy.empty(host.shape, dtype=dtype, order=order)
        if nbytes:
            block = numpy.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dtype)
            block.reshape(host.shape, order=order)[...] = host
            _cuda.memcpy_htod_async(out.data.ptr, ptr, nbytes, self.stream.handle)
        return out

    def finish(self, failed: bool) -> StagedUploads | None:
        """After the capture: the graph's holder, or (failed) the blocks back to the arena."""
        ptrs, self.ptrs = self.ptrs, []
        if not ptrs:
            return None
        if failed:
            self.arena.give_back(ptrs)
            return None
        return StagedUploads(self.arena, self.device, ptrs, self.calls)


def _refusal(call: str, size: int, why: str, fix: str) -> CaptureError:
    return CaptureError("cupy._core.array", 0, "UPLOAD_NOT_COVERED",
                        f"a host-to-device upload of {size} bytes inside the capture [{call}] cannot be staged: {why}",
                        fix)


# ---------------------------------------------------------------- process-wide arena

_arena_lock = threading.Lock()
_arena: PinnedArena | None = None


def arena() -> PinnedArena | None:
    """The process's arena (made on first use), or None when ``CGRAW_PINNED_STAGING_BYTES`` is 0."""
    global _arena
    with _arena_lock:
        if _arena is None:
            n = staging_bytes()
            if n == 0:
                return None
            _arena = PinnedArena(n)
        return _arena


def _sync_devices(devices) -> None:
    from cgraw.runtime.device import Device

    prev = _cuda.ctx_get_current()
    try:
        for d in devices:
            Device(d).set_current()
            _cuda.ctx_synchronize()
    finally:
        if _cuda.native(prev) != 0:
            _cuda.ctx_set_current(prev)


def prepare(device: int, stream=None) -> CaptureStaging:
    """Before a capture begins (nothing routed yet): reuse dead graphs' blocks and reserve the
    arena, both only while no capture routes allocations; the capture's staging (its copies go
    to ``stream``, the capture stream)."""
    a = arena()
    if a is None:
        return CaptureStaging(None, device, "CGRAW_PINNED_STAGING_BYTES is 0 (staging is off)", stream)
    with defer.lock:  # no capture can begin while the arena is reserved or drained
        if not defer.active():
            a.drain(_sync_devices)
            a.grow()
    if not a.ready:
        return CaptureStaging(a, device, "the pinned staging arena is reserved only while no capture runs, "
                                         "and another capture was running when this one began", stream)
    return CaptureStaging(a, device, stream=stream)


# ---------------------------------------------------------------- cupy._core.array

def _host_upload(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, blocking=False):
    """``(numpy array, memory order)`` when ``_core.array`` is asked to upload host data cgraw
    stages (see the module docstring), else None. ``copy`` and ``blocking`` change nothing here."""
    if subok or not _is_host(obj):
        return None
    o = "K" if order is None else order.upper() if isinstance(order, str) else ""
    if o not in _ORDERS:
        return None
    try:
        host = numpy.asarray(obj, dtype=dtype)
    except (TypeError, ValueError, OverflowError):
        return None
    if host.dtype.char not in CUPY_TYPES:
        return None
    if host.ndim < ndmin:
        host = host.reshape((1,) * (ndmin - host.ndim) + host.shape)
    if o in ("A", "K"):
        fortran = isinstance(obj, numpy.ndarray) and obj.flags.f_contiguous and not obj.flags.c_contiguous
        o = "F" if fortran else "C"
    return host, o


def _is_host(obj) -> bool:
    """A NumPy array or scalar, a Python number, or a (nested) list or tuple of those."""
    if type(obj) in (float, int, bool, complex):
        return True
    if isinstance(obj, (list, tuple)):
        return all(_is_host(x) for x in obj)
    if not isinstance(obj, (numpy.ndarray, numpy.generic, int, float, complex)):
        return False
    if hasattr(obj, "__cuda_array_interface__") or hasattr(obj, "__cupy_get_ndarray__"):
        return False
    device = getattr(obj, "__dlpack_device__", None)
    if device is None:
        return True
    try:
        return int(device()[0]) in _DL_HOST
    except Exception:  # not a usable DLPack device: CuPy decides
        return False


def _wrap(original):
    """``cupy._core.array`` that stages this thread's host uploads inside its capture."""

    def array(*args, **kwargs):
        staging = getattr(_tls, "staging", None)
        if staging is None or not _capturing():
            return original(*args, **kwargs)
        found = _host_upload(*args, **kwargs)
        cupy = sys.modules["cupy"]
        if found is None or int(cupy.cuda.get_current_stream().ptr) != staging.stream.ptr:
            return original(*args, **kwargs)
        return staging.upload(cupy, *found, _cupy_call())

    array._cgraw_original = original
    array.__name__ = getattr(original, "__name__", "array")
    array.__doc__ = getattr(original, "__doc__", None)
    return array


def _capturing() -> bool:
    from cgraw.runtime import memory

    return getattr(memory.thread_state, "capturing", 0) > 0


def _cupy_call() -> str:
    """The outermost CuPy/cupyx Python function on the stack ("cupy._creation.from_data.asarray")."""
    from cgraw.interop.cupy.pools import outermost_cupy_frame

    f = sys._getframe(1)
    frames = []
    while f is not None:
        frames.append(f)
        f = f.f_back
    return outermost_cupy_frame(reversed(frames)) or "cupy._core.array"


_install_lock = threading.Lock()
_installs = 0  # captures routing CuPy's uploads; guarded by _install_lock
_wrapper = None  # the wrapper install() set as cupy._core.array; guarded by _install_lock


def install(cupy) -> str:
    """Make ``cupy._core.array`` the staging wrapper (counted); ``""`` or why it was not."""
    global _installs, _wrapper
    core = getattr(cupy, "_core", None)
    with _install_lock:
        if _installs == 0:
            current = getattr(core, "array", None)
            if not callable(current):
                return "this CuPy has no cupy._core.array to stage uploads through"
            _wrapper = _wrap(current)
            core.array = _wrapper
        _installs += 1
        return ""


def uninstall(cupy) -> None:
    """Undo one ``install``; the last puts the previous function back if the wrapper is still set."""
    global _installs, _wrapper
    with _install_lock:
        _installs -= 1
        if _installs > 0:
            return
        _installs = 0
        wrapper, _wrapper = _wrapper, None
        core = cupy._core
        if wrapper is not None and core.array is wrapper:
            core.array = wrapper._cgraw_original


def enter(staging: CaptureStaging) -> None:
    _tls.staging = staging


def leave() -> None:
    _tls.staging = None


__all__ = ["CaptureStaging", "HostSource", "PinnedArena", "StagedUploads", "arena", "install", "prepare",
           "staging_bytes", "uninstall"]

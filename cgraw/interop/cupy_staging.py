"""Host-to-device uploads inside a capture: CuPy's pinned staging from a cgraw arena (issue 17).

Layer L7. How CuPy 14.2 uploads a NumPy array (``cupy._core.core._array_default``, reached from
``cupy.asarray``/``cupy.array`` and from cupyx functions that upload constants, such as
``ndimage.gaussian_filter``'s weights): it allocates a device array, then, the NumPy data not
being pinned, ``pinned_memory.alloc_pinned_memory(nbytes)``, which first runs the pinned watch
list's ``check_and_release`` (``Event.done``: ``cudaEventQuery`` on each pending upload's event)
and then calls the process-global allocator set by ``set_pinned_memory_allocator`` (CuPy's
``PinnedMemoryPool.malloc``: a cached block, or ``cudaHostAlloc``). It copies the data into the
pinned block on the host, enqueues ``cudaMemcpyAsync`` on the current stream, and keeps the block
alive with ``_add_to_watch_list(stream.record(), block)``, whose ``add`` queries the new event at
once. Inside a capture that query is of an event recorded in the capture (907, fatal even in
relaxed mode), ``cudaHostAlloc`` and the pending events' queries are refused in thread-local and
global mode, and the captured copy would read a block CuPy reuses after the event "completes".

While a capture routes CuPy, cgraw makes that path safe:

- ``set_pinned_memory_allocator`` gets a dispatcher (process-global: CuPy has no per-thread pinned
  hook). On a thread inside a cgraw capture that routes CuPy it hands out a block of the pinned
  arena (``PinnedArena``), owned by the graph being captured; on every other thread, and outside
  the capture proper, it calls the allocator that was there before, unchanged. It is installed
  by the first such capture and the previous allocator put back by the last one, unless something
  else replaced the dispatcher meanwhile (that one then stays).
- The capture stream's ``record`` (CuPy's object for cgraw's stream) marks the event of a staged
  upload; ``Event.done`` (patched once) answers True for a marked event without querying it, and
  queries other events in the relaxed capture mode while any cgraw capture routes allocations.
- The arena is one ``cuMemHostAlloc`` segment of ``CGRAW_PINNED_STAGING_BYTES`` (default 16 MiB;
  0 turns staging off), reserved before a capture begins and only while no capture routes
  allocations. A staged block is never reused while its graph lives, so every replay copies the
  bytes of the recording. When the graph is closed or collected its blocks wait until the devices
  have been synchronised (before a later capture, while none runs) and are then reused.

Refused, with a ``CaptureError`` naming the CuPy call: an upload the arena cannot hold, and an
upload with staging off or unavailable. An upload from pinned NumPy memory is not staged by CuPy
(the copy reads the user's memory): its event is not marked and the capture fails as before.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref

import allocator
from cgraw import _cuda, _defer
from cgraw.errors import CaptureError

DEFAULT_BYTES = 16 << 20
ROUND = 512  # CuPy's pinned pool rounds to 512 bytes too


@contextlib.contextmanager
def relaxed():
    """This thread in the relaxed capture mode for the block (calls a stricter capture refuses)."""
    prev = _cuda.thread_exchange_capture_mode(_cuda.CAPTURE_MODES["relaxed"])
    try:
        yield
    finally:
        _cuda.thread_exchange_capture_mode(prev)


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
        if _defer.active():
            raise MemoryError("the pinned staging arena grows only while no capture routes allocations")
        ptr = self._alloc(nbytes)
        self.segments[ptr] = nbytes
        return ptr

    def release(self, addr: int, nbytes: int) -> None:
        del self.segments[addr]
        _defer.release(self._free, addr)


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


class _Block:
    """What CuPy's ``PinnedMemoryPointer`` wraps: ``ptr`` and ``size``; it owns nothing."""

    __slots__ = ("ptr", "size")

    def __init__(self, ptr: int, size: int):
        self.ptr = ptr
        self.size = size


# ---------------------------------------------------------------- the per-capture side

_tls = threading.local()  # .staging: this thread's CaptureStaging; .staged: an upload awaiting its event


class CaptureStaging:
    """One capture's uploads: blocks taken from the arena, and the CuPy calls that made them."""

    def __init__(self, arena: PinnedArena | None, device: int, unavailable: str = ""):
        self.arena = arena
        self.device = device
        self.unavailable = unavailable  # why staging cannot serve this capture, or ""
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
    return CaptureError("cupy.cuda.alloc_pinned_memory", 0, "UPLOAD_NOT_COVERED",
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
    from cgraw.device import Device

    prev = _cuda.ctx_get_current()
    try:
        for d in devices:
            Device(d).set_current()
            _cuda.ctx_synchronize()
    finally:
        if _cuda.native(prev) != 0:
            _cuda.ctx_set_current(prev)


def prepare(device: int) -> CaptureStaging:
    """Before a capture begins (nothing routed yet): reuse dead graphs' blocks and reserve the
    arena, both only while no capture routes allocations; the capture's staging."""
    a = arena()
    if a is None:
        return CaptureStaging(None, device, "CGRAW_PINNED_STAGING_BYTES is 0 (staging is off)")
    with _defer._lock:  # no capture can begin while the arena is reserved or drained
        if not _defer.active():
            a.drain(_sync_devices)
            a.grow()
    if not a.ready:
        return CaptureStaging(a, device, "the pinned staging arena is reserved only while no capture runs, "
                                         "and another capture was running when this one began")
    return CaptureStaging(a, device)


# ---------------------------------------------------------------- CuPy hooks

_install_lock = threading.Lock()
_installs = 0  # captures using the dispatcher; guarded by _install_lock
_previous = None  # the allocator to put back: a callable, or None for CuPy's _malloc
_done_patched = False


def _dispatcher(size):
    """The pinned allocator CuPy calls while cgraw's is installed."""
    if getattr(_tls, "probe", False):
        _tls.probe = False  # uninstall() asking whether this dispatcher is still CuPy's
        return _pointer(_Block(0, 0))
    staging = getattr(_tls, "staging", None)
    if staging is not None and _capturing():
        ptr = staging.allocate(size, _cupy_call())
        _tls.staged = True  # the next event recorded on the capture stream is this upload's
        return _pointer(_Block(ptr, size))
    prev = _previous
    if prev is None:
        return sys.modules["cupy.cuda.pinned_memory"]._malloc(size)
    return prev(size)


def _pointer(block):
    return sys.modules["cupy"].cuda.PinnedMemoryPointer(block, 0)


def _capturing() -> bool:
    from cgraw import memory

    return getattr(memory._tls, "capturing", 0) > 0


def _cupy_call() -> str:
    """The outermost CuPy/cupyx Python function on the stack ("cupy._creation.from_data.asarray")."""
    from cgraw.interop.cupy import outermost_cupy_frame

    f = sys._getframe(1)
    frames = []
    while f is not None:
        frames.append(f)
        f = f.f_back
    return outermost_cupy_frame(reversed(frames)) or "a CuPy upload"


def _identify_current(cupy):
    """The allocator CuPy uses now, found by asking it for a tiny block (outside any capture):
    ``(True, allocator)`` for CuPy's pinned pool or None (``_malloc``); ``(False, None)`` for
    anything else (cgraw cannot put an unknown allocator back, so it does not replace it)."""
    pm = sys.modules["cupy.cuda.pinned_memory"]
    block = cupy.cuda.alloc_pinned_memory(1)
    mem = block.mem
    try:
        if isinstance(mem, pm.PooledPinnedMemory):
            pool = mem.pool() if callable(getattr(mem, "pool", None)) else None
            return (pool is not None), (pool.malloc if pool is not None else None)
        if type(mem) is pm.PinnedMemory:
            return True, None
        return False, None
    finally:
        del block, mem


def install(cupy) -> str:
    """Make the dispatcher CuPy's pinned allocator (counted); ``""`` or why it was not."""
    global _installs, _previous
    with _install_lock:
        if _installs == 0:
            with _defer._lock:  # the probe may cudaHostAlloc: no capture may begin meanwhile
                if _defer.active():
                    return "CuPy's pinned allocator is replaced only while no capture runs"
                known, prev = _identify_current(cupy)
            if not known:
                return "a custom pinned-memory allocator is set (cupy.cuda.set_pinned_memory_allocator)"
            _previous = prev
            cupy.cuda.set_pinned_memory_allocator(_dispatcher)
        _installs += 1
        _patch_event_done(cupy)
        return ""


def uninstall(cupy) -> None:
    """Undo one ``install``; the last puts the previous allocator back if the dispatcher is still set."""
    global _installs, _previous
    with _install_lock:
        _installs -= 1
        if _installs > 0:
            return
        _installs = 0
        _tls.probe = True
        try:
            cupy.cuda.alloc_pinned_memory(0)
            still_ours = not _tls.probe  # the dispatcher answered the probe
        finally:
            _tls.probe = False
        if still_ours:
            cupy.cuda.set_pinned_memory_allocator(_previous)
        _previous = None


def _patch_event_done(cupy) -> None:
    global _done_patched
    if _done_patched:
        return
    Event = cupy.cuda.Event
    original = Event.__dict__.get("done")
    if not isinstance(original, property):
        return  # another CuPy: staged uploads then fail at the query, named as uploads
    fget = original.fget

    def done(self):
        if getattr(self, "_cgraw_staged", False):
            return True  # a staged upload's event, recorded inside a capture: its block is the graph's
        if not _defer.active():
            return fget(self)
        with relaxed():
            return fget(self)

    done._cgraw_wrapped = fget
    Event.done = property(done, doc=original.__doc__)
    _done_patched = True


def hook_stream(stream) -> bool:
    """Give CuPy's object for the capture stream a ``record`` that marks staged uploads' events."""
    record = stream.record

    def staged_record(event=None):
        if not getattr(_tls, "staged", False):
            return record(event)
        _tls.staged = False
        with relaxed():
            ev = record(event)  # a real record: other work may wait on it
        ev._cgraw_staged = True
        return ev

    try:
        stream.record = staged_record
    except (AttributeError, TypeError):
        return False
    return True


def enter(staging: CaptureStaging) -> None:
    _tls.staging = staging
    _tls.staged = False


def leave() -> None:
    _tls.staging = None
    _tls.staged = False


__all__ = ["CaptureStaging", "HostSource", "PinnedArena", "StagedUploads", "arena", "hook_stream", "install",
           "prepare", "staging_bytes", "uninstall"]

"""Device memory: a segment source over cuMemAlloc, and ``DevicePool``.

Layer L2: imports ``_cuda``, ``device``, ``stream`` and the ``allocator`` package. A
``DevicePool`` is an ``allocator.Pool`` whose segments come from the driver; stream ids are
raw stream handles (ints). It can serve CuPy through ``cupy.cuda.using_allocator``.
"""

from __future__ import annotations

import sys
import threading
import weakref

import allocator
from cgraw import _cuda
from cgraw.device import Device
from cgraw.stream import Stream

_tls = threading.local()


class CudaSource:
    """``allocator.SegmentSource`` backed by ``cuMemAlloc``/``cuMemFree`` on one device.

    A segment may be reserved while a stream of this thread is capturing (a pool growing during
    capture). ``cuMemAlloc`` is only legal then in relaxed mode, so ``reserve`` exchanges the
    thread's capture mode to relaxed around the call and puts it back afterwards.
    """

    def __init__(self, device: Device):
        self.device = device
        self.reserved_bytes = 0
        self.segments: dict[int, int] = {}  # base -> nbytes of every segment held from the driver

    def reserve(self, nbytes: int) -> int:
        self.device.set_current()
        prev = _cuda.thread_exchange_capture_mode(_cuda.CAPTURE_MODES["relaxed"])
        try:
            ptr = _cuda.mem_alloc(nbytes)
        finally:
            _cuda.thread_exchange_capture_mode(prev)
        self.reserved_bytes += nbytes
        self.segments[ptr] = nbytes
        return ptr

    def release(self, addr: int, nbytes: int) -> None:
        self.device.set_current()
        _cuda.mem_free(addr)
        self.reserved_bytes -= nbytes
        del self.segments[addr]

    def release_all_quietly(self) -> None:
        """Finalizer of a pool that was never closed: give every segment back. Never raises."""
        for addr in list(self.segments):
            _cuda.destroy_quietly(_cuda.drv.cuMemFree, addr, "mem")
        self.segments.clear()
        self.reserved_bytes = 0


class CudaStreamEvents:
    """``allocator.StreamEvents`` over CUDA events: tells the pool when a free has completed.

    While any cgraw capture is running on this thread, recording or querying an uncaptured event
    would invalidate it, so ``record`` returns None there and ``query(None)`` is False: the pool
    then grows instead of reusing another stream's blocks.
    """

    def __init__(self, device: Device):
        self.device = device

    def record(self, stream_id: int):
        if getattr(_tls, "capturing", 0):
            return None
        ev = _cuda.event_create()
        _cuda.event_record(ev, _cuda.drv.CUstream(stream_id))
        return _EventToken(ev)

    def query(self, token) -> bool:
        if token is None or getattr(_tls, "capturing", 0):
            return False
        return _cuda.event_query(token.event)


class _EventToken:
    __slots__ = ("event",)

    def __init__(self, event):
        self.event = event

    def __del__(self):
        _cuda.destroy_quietly(_cuda.drv.cuEventDestroy, self.event, "event")


def capture_guard_enter() -> None:
    """Mark this thread as capturing (the pool then avoids event queries)."""
    _tls.capturing = getattr(_tls, "capturing", 0) + 1


def capture_guard_exit() -> None:
    _tls.capturing = getattr(_tls, "capturing", 1) - 1


class DevicePool(allocator.Pool):
    """A device-memory pool on one device. Stream ids are raw stream handles.

    Args:
        device: a ``Device`` or ordinal; the current device if None.
        limit: the most bytes the pool may reserve from the driver, or None.
        name: shown in errors and reports.
    """

    def __init__(self, device: Device | int | None = None, *, limit: int | None = None, name: str = "cgraw"):
        if device is None:
            device = Device.current()
        elif not isinstance(device, Device):
            device = Device(int(device))
        self.device = device
        source = CudaSource(device)
        super().__init__(source, limit=limit, events=CudaStreamEvents(device), name=name)
        # a pool nobody closed returns its memory when it is collected (the finalizer holds the
        # source, never the pool)
        self._finalizer = weakref.finalize(self, source.release_all_quietly)
        self.torch_state = None  # (torch MemPool, its cgraw sub-pool), set by interop.torch
        self.consumer_holds: dict[int, int] = {}  # ptr -> DLPack exports not yet released
        self._capture_stream: Stream | None = None

    @property
    def capture_stream(self) -> Stream:
        """The pool's capture stream: every capture into this pool runs on it, so freed blocks
        are reused in stream order without events."""
        s = self._capture_stream
        if s is None:
            s = self._capture_stream = Stream.create(self.device)
        return s

    @property
    def torch_reserved_bytes(self) -> int:
        """Bytes of this pool's segments that torch's MemPool holds."""
        return 0 if self.torch_state is None else self.torch_state[1].stats().reserved_bytes

    def close(self) -> None:
        """Return every segment to the driver. Torch's segments go back once torch releases them."""
        super().close()
        if self.torch_state is not None:
            sub = self.torch_state[1]
            if not sub.closed and sub.stats().live_blocks == 0:
                sub.close()

    def cupy_allocator(self, owners: list | None = None):
        """An allocator for ``cupy.cuda.using_allocator``: each array's memory is a pool block.

        Blocks are taken on CuPy's current stream and go back to the pool when the array dies.
        If ``owners`` is given, a weak reference to each block's owner is appended to it (a
        failed capture uses them to disown blocks its pool restore already took back).
        """
        import cupy

        pool = self
        dev_id = self.device.ordinal
        get_stream = cupy.cuda.get_current_stream
        UnownedMemory = cupy.cuda.UnownedMemory
        MemoryPointer = cupy.cuda.MemoryPointer
        ref = weakref.ref

        def malloc(nbytes: int):
            sid = get_stream().ptr
            block = pool.malloc(max(int(nbytes), 1), stream=sid)
            owner = _BlockOwner(pool, block.ptr, sid)
            if owners is not None:
                owners.append(ref(owner))
            return MemoryPointer(UnownedMemory(block.ptr, nbytes, owner, dev_id), 0)

        return malloc


class _BlockOwner:
    """Frees a pool block when the last CuPy array using it dies. Never raises."""

    __slots__ = ("pool", "ptr", "stream", "__weakref__")

    def __init__(self, pool, ptr: int, stream: int):
        self.pool = pool
        self.ptr = ptr
        self.stream = stream

    def disown(self) -> None:
        """The pool took this block back already (a restore); do not free it again."""
        self.pool = None

    def __del__(self):
        if self.pool is not None:
            free_quietly(self.pool, self.ptr, self.stream)


def free_quietly(pool, ptr: int, stream: int) -> None:
    """Give a block back from a destructor: never raises. A failure outside interpreter shutdown
    becomes a ``ResourceLeakWarning`` (an error in the test suite)."""
    try:
        if not pool.closed:
            pool.free(ptr, stream=stream)
    except Exception as exc:
        if not sys.is_finalizing():
            import warnings

            from cgraw.errors import ResourceLeakWarning

            warnings.warn(ResourceLeakWarning(f"freeing pool block 0x{ptr:x} failed: {exc!r}"))


__all__ = ["CudaSource", "CudaStreamEvents", "DevicePool", "free_quietly"]

"""Device memory: a segment source over cuMemAlloc, and ``DevicePool``.

Layer L4: imports ``_cuda``, ``defer``, ``device``, ``stream`` and the ``allocator`` package. A
``DevicePool`` is an ``allocator.Pool`` whose segments come from the driver; stream ids are
raw stream handles (ints). It can serve CuPy through ``cupy.cuda.using_allocator``.

Memory a live graph uses is never handed to anything but a later capture into the same pool:
blocks freed on the pool's capture stream (a graph's temporaries, its outputs once they die)
stay there while any graph captured into the pool is alive, instead of migrating to eager
allocations on other streams, and ``trim()`` keeps their segments. Segments are returned to the
driver only once no capture routes allocations (``cgraw._cuda.defer``).
"""

from __future__ import annotations

import sys
import threading
import weakref

import allocator
from cgraw import _cuda
from cgraw._cuda import defer
from cgraw.runtime.device import Device
from cgraw.runtime.stream import Stream

thread_state = threading.local()  # .capturing: this thread's captures that route allocations now


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
        self.reserved_bytes -= nbytes
        del self.segments[addr]
        # cuMemFree on a capturing thread would invalidate its capture: wait for captures to end
        defer.release(_free_segment, self.device, addr)

    def release_all_quietly(self) -> None:
        """Finalizer of a pool that was never closed: give every segment back. Never raises."""
        for addr in list(self.segments):
            _cuda.destroy_quietly("mem", addr)
        self.segments.clear()
        self.reserved_bytes = 0


def _free_segment(device: Device, addr: int) -> None:
    device.set_current()
    _cuda.mem_free(addr)


class CudaStreamEvents:
    """``allocator.StreamEvents`` over CUDA events: tells the pool when a free has completed.

    While any cgraw capture is running on this thread, recording or querying an uncaptured event
    would invalidate it, so ``record`` returns None there and ``query(None)`` is False: the pool
    then grows instead of reusing another stream's blocks.
    """

    def __init__(self, device: Device):
        self.device = device

    def record(self, stream_id: int):
        if getattr(thread_state, "capturing", 0):
            return None
        ev = _cuda.event_create()
        _cuda.event_record(ev, _cuda.stream_handle(stream_id))
        return _EventToken(ev)

    def query(self, token) -> bool:
        if token is None or getattr(thread_state, "capturing", 0):
            return False
        return _cuda.event_query(token.event)


class _EventToken:
    __slots__ = ("event",)

    def __init__(self, event):
        self.event = event

    def __del__(self):
        _cuda.destroy_quietly("event", self.event)


def capture_guard_enter() -> None:
    """Mark this thread as capturing (the pool then avoids event queries)."""
    thread_state.capturing = getattr(thread_state, "capturing", 0) + 1


def capture_guard_exit() -> None:
    thread_state.capturing = getattr(thread_state, "capturing", 1) - 1


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
        # torch's side of the pool (interop.torch.TorchPool), once a capture routes torch into it.
        # The finalizer holds this list, never the pool: when the pool dies, the torch MemPool is
        # dropped and the segments released once no capture routes allocations (torch aborts the
        # process if a MemPool dies while any capture routes into a pool).
        self._torch_holder: list = []
        self._finalizer = weakref.finalize(self, _release_pool, source, self._torch_holder)
        self.consumer_holds: dict[int, int] = {}  # ptr -> DLPack exports not yet released
        self._capture_stream: Stream | None = None
        self._graphs = weakref.WeakSet()  # live graphs captured into this pool
        self._graph_streams: set[int] = set()  # streams that allocated during a capture

    @property
    def torch_state(self):
        """The ``interop.torch.TorchPool`` routing torch into this pool, or None."""
        h = self._torch_holder
        return h[0] if h else None

    @torch_state.setter
    def torch_state(self, value) -> None:
        self._torch_holder[:] = [] if value is None else [value]

    @property
    def capture_stream(self) -> Stream:
        """The pool's capture stream: every capture into this pool runs on it, so freed blocks
        are reused in stream order without events. Leased (``_lease_stream``): never destroyed."""
        s = self._capture_stream
        if s is None:
            s = self._capture_stream = _lease_stream(self.device)
            weakref.finalize(self, _return_stream, self.device.ordinal, s)
        return s

    @property
    def torch_reserved_bytes(self) -> int:
        """Bytes of the segments torch's MemPool for this pool holds."""
        tp = self.torch_state
        return 0 if tp is None else tp.reserved_bytes()

    # ------------------------------------------------------------------ live graphs

    def _register_graph(self, graph) -> None:
        self._graphs.add(graph)

    def _unregister_graph(self, graph) -> None:
        self._graphs.discard(graph)

    def _pinned_streams(self):
        """Streams whose free blocks stay put (``allocator.Pool``): the capture stream's and those
        of side streams that allocated during a capture, while a graph captured into this pool is
        alive, so eager allocations never get graph memory."""
        if not len(self._graphs):
            return ()
        s = self._capture_stream
        return self._graph_streams | ({s.ptr} if s is not None else set())

    def close(self) -> None:
        """Close every graph captured into this pool, then return every segment to the driver
        (once no capture routes allocations). Torch's segments go back once its tensors die."""
        for g in list(self._graphs):
            g.close()
        super().close()
        holder = self._torch_holder
        if holder:
            defer.release(_drop_torch, holder[:])
            holder.clear()

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
        stress = defer.gc_stress if defer.CGRAW_GC_STRESS else None

        graph_streams = self._graph_streams
        deferred = defer

        def malloc(nbytes: int):
            sid = get_stream().ptr
            if deferred.active_count:  # a capture routes allocations (this thread's, or another's)
                if stress is not None:
                    stress()
                if sid not in graph_streams:
                    graph_streams.add(sid)  # a side stream of a capture: its frees stay pinned too
            block = pool.malloc(max(int(nbytes), 1), stream=sid)
            owner = _BlockOwner(pool, block.ptr, sid)
            if owners is not None:
                owners.append(ref(owner))
            return MemoryPointer(UnownedMemory(block.ptr, nbytes, owner, dev_id), 0)

        return malloc


_spare_streams: dict[int, list] = {}  # device ordinal -> capture streams of pools that are gone
_streams_lock = threading.Lock()


def _lease_stream(device: Device) -> Stream:
    """A capture stream for a new pool: one a pool that is gone used, or a new one. A capture
    stream is never destroyed: torch's allocator records events on the streams a block was used on
    when the block's tensor dies (an autograd graph's saved tensor may die long after its tree),
    and cuEventRecord on a destroyed stream crashes the process (seen on the H200)."""
    with _streams_lock:
        spare = _spare_streams.get(device.ordinal)
        if spare:
            return spare.pop()
    return Stream.create(device)


def _return_stream(ordinal: int, stream: Stream) -> None:
    """Finalizer of a pool: its capture stream waits for the next pool. Never raises."""
    with _streams_lock:
        _spare_streams.setdefault(ordinal, []).append(stream)


def _release_pool(source: CudaSource, torch_holder: list) -> None:
    """Finalizer of a ``DevicePool``: drop torch's MemPool and give every segment back, once no
    capture routes allocations. Never raises."""
    defer.release(_release_pool_now, source, torch_holder)


def _release_pool_now(source: CudaSource, torch_holder: list) -> None:
    _drop_torch(torch_holder)
    source.release_all_quietly()


def _drop_torch(items: list) -> None:
    """Drop torch's side of a pool (``interop.torch.TorchPool``), closing it first so that its
    MemPool can give its segments back. Never raises."""
    for item in items:
        close = getattr(item, "close", None)
        if close is not None:
            close()
    items.clear()


class _BlockOwner:
    """Frees a pool block when the last CuPy array using it dies. Never raises."""

    __slots__ = ("pool", "ptr", "stream", "keep", "__weakref__")

    def __init__(self, pool, ptr: int, stream: int):
        self.pool = pool
        self.ptr = ptr
        self.stream = stream
        self.keep = None

    def disown(self) -> None:
        """The pool's bookkeeping owns this block now (a restore, a graph tree): do not free it,
        but keep the pool, and so its segments, alive as long as the array is."""
        self.keep = self.pool
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

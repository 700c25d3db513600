"""torch adapter: route torch's allocations into a private pool during a capture.

Layer L7: imports cgraw's lower layers; torch is only used when the user has imported it, and its
private API only through ``interop.torch.private_api``.

Mechanism: each ``DevicePool`` gets one plain ``torch.cuda.MemPool`` (``TorchPool``): torch's own
caching allocator, ``cudaMalloc``-ing its segments itself, inside a private pool. Around a capture
cgraw enters ``torch.cuda.use_mem_pool`` before ``cuStreamBeginCapture`` and leaves it after
``cuStreamEndCapture``, and makes the capture stream torch's current stream, so torch allocates
with its relaxed-capture guard. Outside captures torch's allocator is untouched.

Why not segments from cgraw's pool through ctypes callbacks (``_cuda_customAllocator``, an
earlier design): torch calls a custom allocator while it holds its allocator mutex, a
Python callback needs the GIL, and another thread holding the GIL while it waits for that mutex
(``torch.cuda.memory_allocated()``) deadlocks both. ``python -m benchmarks.allocator_threads``
measures it: with callbacks, 0 of 500 captures completed before the 40 s timeout; with torch's
own allocator, 500 of 500 in 6.9 s (``benchmarks/results/allocator_threads.json``). cgraw still
accounts for the segments (``TorchPool.segments``) and checkpoints them in graph trees.
"""

from __future__ import annotations

import sys
from bisect import bisect_right

from cgraw._cuda import defer
from cgraw.interop.torch import private_api

HOST_SYNC = (
    "host synchronisation is not capturable: .item(), .cpu(), .tolist(), .get(), printing a device "
    "value, nonzero()/boolean masks and torch.cuda.synchronize() wait for the GPU, which a graph "
    "cannot do; move them out of the captured region"
)
H2D = (
    "a host-to-device copy from pageable memory is not capturable (torch.tensor([...], device='cuda'), "
    "x.cuda() or x.to('cuda') of a CPU tensor): make the tensor before the capture and pass it in, "
    "or copy from pinned memory (x.pin_memory()) with non_blocking=True"
)
RNG = (
    "torch random numbers from torch's own CUDA generator cannot be captured by cgraw ('generator not "
    "in capture mode'): cgraw draws them itself unless the capture has random=False; draw the random "
    "tensor outside the capture and pass it in, or leave random on"
)
LEGACY_WAIT = (
    "the legacy default stream was made to wait on the capture (cudaErrorStreamCaptureImplicit): work "
    "on torch.cuda.default_stream() or another blocking stream cannot join a capture, nor can an "
    "autograd node made on it (a parameter's AccumulateGrad kept alive by the previous step's graph); "
    "make that work on a non-blocking stream, or run it outside the captured region"
)
CUBLAS_COLD = (
    "cuBLAS was not initialised on this thread before the capture; run one matmul before capturing "
    "(cgraw.capture(warmup=fn) does this) and capture again"
)


def torch_module():
    """The torch module if the user imported it, else None (cgraw never imports torch itself)."""
    return sys.modules.get("torch")


class TorchPool:
    """torch's side of a cgraw pool: a private ``torch.cuda.MemPool`` on torch's own allocator.

    Dropping the last reference destroys the MemPool, which releases its cached segments; that
    must never happen while a capture routes allocations (``DevicePool`` defers it).
    """

    __slots__ = ("torch", "device", "mempool", "id")

    def __init__(self, torch, device_ordinal: int):
        self.torch = torch
        self.device = device_ordinal
        self.mempool = torch.cuda.MemPool()
        self.id = self.mempool.id

    def _snapshot(self) -> list:
        """The segments of this MemPool. Never ``self.mempool.snapshot()``: that hands torch the
        pool's id to parse, and torch 2.11 frees the id's int while it is in use
        (``interop.torch.private_api.memory_segments``)."""
        pid, dev = tuple(self.id), self.device
        return [s for s in private_api.memory_segments()
                if s.get("device", dev) == dev and tuple(s["segment_pool_id"]) == pid]

    def segments(self) -> list[tuple[int, int]]:
        """``(address, bytes)`` of the pool's segments, by address."""
        return sorted((int(s["address"]), int(s["total_size"])) for s in self._snapshot())

    def allocated(self) -> dict[int, int]:
        """``address -> bytes requested`` of the pool's blocks that are allocated now."""
        return {int(b["address"]): int(b.get("requested_size") or b["size"])
                for s in self._snapshot() for b in s["blocks"] if b["state"] != "inactive"}

    def reserved_bytes(self) -> int:
        return sum(n for _, n in self.segments())

    def owner_of(self):
        """A function ``ptr -> bool``: whether ``ptr`` lies in one of the segments (read now)."""
        segs = self.segments()
        bases = [b for b, _ in segs]

        def owns(ptr: int) -> bool:
            i = bisect_right(bases, ptr) - 1
            return i >= 0 and ptr < segs[i][0] + segs[i][1]

        return owns

    def close(self) -> None:
        """Before the MemPool goes: free torch's cuBLAS workspaces. torch keeps one per (cuBLAS
        handle, stream) in a map that outlives every pool, and the one a capture's warm-up made
        for this pool's capture stream is a block of this MemPool: it would keep the MemPool's
        private pool, and a segment of device memory, allocated for the life of the process
        (79 such pools were counted in one GPU test file). torch makes workspaces again when
        next needed, and graph trees clear them at every recording too. A live graph of another
        pool whose workspace this frees keeps it as one of its temporaries (README: graphs that
        share a pool replay in capture order). Never raises."""
        try:
            private_api.api()._cuda_clearCublasWorkspaces()
        except Exception:  # noqa: BLE001 - a finalizer path: the pool then keeps its workspace
            pass

    def checkpoint(self):
        """torch's checkpoint of the pool and the blocks allocated at it."""
        state = private_api.api()._cuda_getCheckpointState(self.device, self.id)
        return state, self.allocated()


def torch_pool_for(pool) -> TorchPool:
    """The ``TorchPool`` of a ``DevicePool`` (created on first use)."""
    tp = pool.torch_state
    if tp is None:
        tp = TorchPool(sys.modules["torch"], pool.device.ordinal)
        pool.torch_state = tp
    return tp


class TorchRouting:
    """Brackets a capture for torch: pool routing, current stream and device, cuBLAS warm-up."""

    def __init__(self, pool, stream, *, warm_cublas: bool = True, clear_workspaces: bool = False,
                 route: str = "thread", empty_cache: bool = False):
        self.torch = sys.modules["torch"]
        self.clear_workspaces = clear_workspaces
        self.empty_cache = empty_cache
        # "thread": this thread's allocations, side streams included (torch.cuda.use_mem_pool).
        # "stream": allocations on the capture stream from any thread, which is where autograd's
        # device thread runs a backward pass; side streams are then not routed.
        self.route = route
        self.pool = pool
        self.stream = stream
        self.warm_cublas = warm_cublas
        self._pool_ctx = None
        self._stream_ctx = None
        self._prev_device = None

    def producer_streams(self) -> list[int]:
        """torch's current stream: the capture must come after the work queued there."""
        return [int(private_api.api()._cuda_getCurrentRawStream(self.pool.device.ordinal))]

    def prepare(self) -> None:
        """Before the capture begins, while nothing is routed. For a graph tree's recording
        (``clear_workspaces``): this thread's cuBLAS handle, made outside the pool, and every
        cuBLAS workspace dropped, so that the workspace a captured matmul needs is made in the
        pool then, and only then (a warm-up inside the routing would leave a 32 MiB segment in every
        tree on the H200; ``tools/probes/pool_probe.py`` shows a tree's segments); then, with ``empty_cache``, torch's cached free memory
        released, as ``torch.cuda.graph`` does before every capture (torch's trees record through
        it): what warm-ups and dropped workspaces left cached is not kept beside the tree's pool.
        Not while another capture or in-pool warm-up routes allocations (``cgraw._cuda.defer``): torch
        asserts then."""
        if not self.clear_workspaces:
            return
        torch = self.torch
        if self.warm_cublas:
            a = torch.ones((2, 2), device=torch.device("cuda", self.pool.device.ordinal))
            (a @ a).sum()
        private_api.api()._cuda_clearCublasWorkspaces()
        if self.empty_cache:
            with defer.lock:
                if not defer.active():
                    torch.cuda.empty_cache()

    def unprepare(self, failed: bool = True) -> None:
        """Nothing to undo (``prepare`` only released memory)."""

    def enter(self) -> None:
        torch = self.torch
        dev = self.pool.device.ordinal
        tc = private_api.api()
        tp = torch_pool_for(self.pool)
        self._prev_device = torch.cuda.current_device()
        ext = torch.cuda.ExternalStream(self.stream.ptr, device=torch.device("cuda", dev))
        if self.route == "thread":
            self._pool_ctx = torch.cuda.use_mem_pool(tp.mempool, device=dev)
            self._pool_ctx.__enter__()
        try:
            self._stream_ctx = torch.cuda.stream(ext)
            self._stream_ctx.__enter__()
            if self.route == "stream":
                tc._cuda_beginAllocateCurrentStreamToPool(dev, tp.id)
                self._pool_ctx = _StreamRouting(tc, dev, tp.id)
            if self.warm_cublas and not self.clear_workspaces:
                # creates this thread's cuBLAS handle and the capture stream's workspace (in the pool)
                a = torch.ones((2, 2), device=torch.device("cuda", dev))
                (a @ a).sum()
        except BaseException:
            self.exit()
            raise

    def exit(self, failed: bool = False) -> None:
        try:
            if self._stream_ctx is not None:
                self._stream_ctx.__exit__(None, None, None)
        finally:
            self._stream_ctx = None
            try:
                if self.clear_workspaces:
                    private_api.api()._cuda_clearCublasWorkspaces()
            finally:
                try:
                    if self._pool_ctx is not None:
                        ctx, self._pool_ctx = self._pool_ctx, None
                        ctx.__exit__(None, None, None)
                finally:
                    prev, self._prev_device = self._prev_device, None
                    if prev is not None and self.torch.cuda.current_device() != prev:
                        self.torch.cuda.set_device(prev)

    @staticmethod
    def classify(exc: BaseException) -> str | None:
        msg = str(exc)
        if "generator not in capture mode" in msg:
            return RNG
        if "CUBLAS_STATUS_NOT_INITIALIZED" in msg and not type(exc).__module__.startswith("cupy"):
            return CUBLAS_COLD
        if "Cannot copy between CPU and CUDA tensors during CUDA graph capture" in msg:
            # torch says the same for both directions; the user's line tells which it was
            line = (user_frame(exc) or ("", 0, ""))[2].replace(" ", "").lower()
            if any(k in line for k in (".cpu(", "'cpu'", '"cpu"', ".numpy(", ".tolist(", ".item(")):
                return HOST_SYNC
            return H2D
        if "cudaErrorStreamCaptureImplicit" in msg or "legacy stream depend on a capturing" in msg:
            return LEGACY_WAIT
        if ("operation not permitted when stream is capturing" in msg
                or "during CUDA graph capture" in msg
                or "cudaErrorStreamCaptureUnsupported" in msg
                or "cudaErrorStreamCaptureInvalidated" in msg
                or "stream capture" in msg.lower() and "invalidated" in msg.lower()):
            return HOST_SYNC
        return None


def user_frame(exc: BaseException):
    """``(file, line, source)`` of the innermost traceback frame outside torch, CuPy and cgraw
    (the user's line that failed), or None."""
    import linecache
    import os

    skip = tuple(os.sep + p + os.sep for p in ("torch", "cupy", "cupyx", "cupy_backends", "cgraw"))
    found = None
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if not any(p in code.co_filename for p in skip) and not code.co_filename.startswith("<frozen"):
            found = (code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    if found is None:
        return None
    return found[0], found[1], linecache.getline(found[0], found[1]).strip()


class _StreamRouting:
    """Undoes ``_cuda_beginAllocateCurrentStreamToPool`` the way ``use_mem_pool`` undoes its own."""

    def __init__(self, tc, dev: int, pool_id):
        self.tc, self.dev, self.pool_id = tc, dev, pool_id

    def __exit__(self, *exc):
        try:
            self.tc._cuda_endAllocateToPool(self.dev, self.pool_id)
        finally:
            self.tc._cuda_releasePool(self.dev, self.pool_id)


def side_streams(capture_id: int, origin_ptr: int, stream_capture_info) -> list[int]:
    """torch and CuPy streams (alive now) capturing into ``capture_id``, other than the origin.

    Scans the garbage collector's objects, so it is only called on the error path.
    """
    import gc

    torch = torch_module()
    cupy = sys.modules.get("cupy")
    kinds = []
    if torch is not None:
        kinds.append((torch.cuda.Stream, "cuda_stream"))
    if cupy is not None:
        kinds.append((cupy.cuda.Stream, "ptr"))
    if not kinds:
        return []
    found: list[int] = []
    for obj in gc.get_objects():
        t = type(obj)  # type(), not isinstance(): no module __getattr__ runs on odd objects
        for cls, attr in kinds:
            if t is cls or issubclass(t, cls):
                try:
                    ptr = int(getattr(obj, attr))
                    if ptr in (0, 1, 2, origin_ptr) or ptr in found:
                        continue
                    status, cid = stream_capture_info(ptr)
                except Exception:
                    continue
                if status == 1 and cid == capture_id:
                    found.append(ptr)
    return found

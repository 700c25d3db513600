"""torch adapter: route torch's allocations into a cgraw pool during a capture.

Layer L5: imports cgraw's lower layers; torch is only used when the user has imported it.

Mechanism (see shared/reference/interop.md section 1.5): each ``DevicePool`` gets one
``torch.cuda.MemPool`` whose segments come from a cgraw sub-pool through ctypes callbacks
(``torch._C._cuda_customAllocator``). Around a capture, cgraw enters ``torch.cuda.use_mem_pool``
before ``cuStreamBeginCapture`` and leaves it after ``cuStreamEndCapture``, and makes the capture
stream torch's current stream. Outside captures torch's allocator is untouched, so eager torch
code pays nothing. Torch sub-allocates inside the segments and keeps freed blocks cached in the
MemPool (reused by later captures into the same pool); segments go back to cgraw when torch
releases them (after the MemPool dies, at ``torch.cuda.empty_cache()``).
"""

from __future__ import annotations

import ctypes
import logging
import sys
import weakref

import allocator
from cgraw.memory import CudaSource

log = logging.getLogger("cgraw")

_ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
# torch may call a pool's callbacks until it releases the pool's last segment, possibly at
# interpreter exit: the CFUNCTYPE objects live for the life of the process.
_callbacks: list = []

HOST_SYNC = (
    "host synchronisation is not capturable: .item(), .cpu(), .tolist(), .get(), printing a device "
    "value, nonzero()/boolean masks and torch.cuda.synchronize() wait for the GPU, which a graph "
    "cannot do; move them out of the captured region"
)
RNG = (
    "torch random numbers are not capturable by cgraw (torch.rand*, dropout in training mode, ...): "
    "'generator not in capture mode'; draw the random tensor outside the capture and pass it in"
)
CUBLAS_COLD = (
    "cuBLAS was not initialised on this thread before the capture; run one matmul before capturing "
    "(cgraw.capture(warmup=fn) does this) and capture again"
)


def torch_module():
    """The torch module if the user imported it, else None (cgraw never imports torch itself)."""
    return sys.modules.get("torch")


def mempool_for(pool):
    """The ``torch.cuda.MemPool`` feeding on ``pool`` (created on first use)."""
    state = pool.torch_state
    if state is not None:
        return state[0]
    torch = sys.modules["torch"]
    sub = allocator.Pool(CudaSource(pool.device), name=f"{pool.name}/torch")

    def alloc(size, device, stream):
        try:
            return sub.malloc(int(size), stream=0).ptr
        except BaseException as exc:  # a ctypes callback must not raise: NULL means OOM to torch
            log.warning("cgraw: torch segment of %d bytes could not be allocated: %s", size, exc)
            return None

    parent = weakref.ref(pool)

    def free(ptr, size, device, stream, _finalizing=sys.is_finalizing, _log=log):
        # bound defaults: at interpreter exit this module's globals may already be gone
        try:
            if _finalizing():
                return
            if not sub.closed:
                sub.free(int(ptr), stream=0)
                owner = parent()
                if (owner is None or owner.closed) and sub.stats().live_blocks == 0:
                    sub.close()  # the cgraw pool is gone: give torch's last segments back
        except BaseException as exc:
            try:
                _log.warning("cgraw: returning torch segment 0x%x failed: %s", ptr or 0, exc)
            except BaseException:
                pass

    a, f = _ALLOC(alloc), _FREE(free)
    _callbacks.append((a, f))
    custom = torch._C._cuda_customAllocator(
        ctypes.cast(a, ctypes.c_void_p).value, ctypes.cast(f, ctypes.c_void_p).value
    )
    mp = torch.cuda.MemPool(custom)
    pool.torch_state = (mp, sub)
    return mp


class TorchRouting:
    """Brackets a capture for torch: pool routing, current stream, cuBLAS warm-up."""

    def __init__(self, pool, stream, *, warm_cublas: bool = True, clear_workspaces: bool = False,
                 route: str = "thread"):
        self.torch = sys.modules["torch"]
        self.clear_workspaces = clear_workspaces
        # "thread": this thread's allocations, side streams included (torch.cuda.use_mem_pool).
        # "stream": allocations on the capture stream from any thread, which is where autograd's
        # device thread runs a backward pass; side streams are then not routed.
        self.route = route
        self.pool = pool
        self.stream = stream
        self.warm_cublas = warm_cublas
        self._pool_ctx = None
        self._stream_ctx = None

    def producer_streams(self) -> list[int]:
        """torch's current stream: the capture must come after the work queued there."""
        return [int(self.torch.cuda.current_stream(self.pool.device.ordinal).cuda_stream)]

    def enter(self) -> None:
        torch = self.torch
        dev = self.pool.device.ordinal
        mp = mempool_for(self.pool)
        ext = torch.cuda.ExternalStream(self.stream.ptr, device=torch.device("cuda", dev))
        if self.route == "thread":
            self._pool_ctx = torch.cuda.use_mem_pool(mp, device=dev)
            self._pool_ctx.__enter__()
        try:
            self._stream_ctx = torch.cuda.stream(ext)
            self._stream_ctx.__enter__()
            if self.route == "stream":
                torch._C._cuda_beginAllocateCurrentStreamToPool(dev, mp.id)
                self._pool_ctx = _StreamRouting(torch, dev, mp.id)
            if self.clear_workspaces:
                # workspaces made next land in the pool and are freed after the capture: scratch
                # memory of this recording only (as torch's own graph trees do)
                torch._C._cuda_clearCublasWorkspaces()
            if self.warm_cublas:
                # creates this thread's cuBLAS handle and the capture stream's workspace (in the pool)
                a = torch.ones((2, 2), device=torch.device("cuda", dev))
                (a @ a).sum()
        except BaseException:
            self.exit()
            raise

    def exit(self) -> None:
        try:
            if self._stream_ctx is not None:
                self._stream_ctx.__exit__(None, None, None)
        finally:
            self._stream_ctx = None
            try:
                if self.clear_workspaces:
                    self.torch._C._cuda_clearCublasWorkspaces()
            finally:
                if self._pool_ctx is not None:
                    ctx, self._pool_ctx = self._pool_ctx, None
                    ctx.__exit__(None, None, None)

    @staticmethod
    def classify(exc: BaseException) -> str | None:
        msg = str(exc)
        if "generator not in capture mode" in msg:
            return RNG
        if "CUBLAS_STATUS_NOT_INITIALIZED" in msg:
            return CUBLAS_COLD
        if ("operation not permitted when stream is capturing" in msg
                or "during CUDA graph capture" in msg
                or "cudaErrorStreamCaptureUnsupported" in msg
                or "cudaErrorStreamCaptureInvalidated" in msg
                or "stream capture" in msg.lower() and "invalidated" in msg.lower()):
            return HOST_SYNC
        return None


class _StreamRouting:
    """Undoes ``_cuda_beginAllocateCurrentStreamToPool`` the way ``use_mem_pool`` undoes its own."""

    def __init__(self, torch, dev: int, pool_id):
        self.torch, self.dev, self.pool_id = torch, dev, pool_id

    def __exit__(self, *exc):
        try:
            self.torch._C._cuda_endAllocateToPool(self.dev, self.pool_id)
        finally:
            self.torch._C._cuda_releasePool(self.dev, self.pool_id)


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

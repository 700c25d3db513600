"""The CUDA call layer: the only package that imports ``cuda.bindings``.

Layer L1. Every driver call cgraw makes goes through ``check`` (or, on the hot paths, through a
bound function whose result is compared with 0 inline). Wrappers are the driver call with ``cu``
dropped and the rest in snake_case (``cuStreamBeginCapture`` -> ``stream_begin_capture``). Nothing
here runs at import: the driver is loaded by the first call, and a machine with no driver or no
device gets one ``CudaUnavailableError``. Imports only ``errors`` and ``defer`` from cgraw, besides
its own modules: ``compat`` (which picks, once, the calls that differ between cuda-bindings 12.8+
and 13.x) and ``graphs`` (capture, instantiate, launch and node queries, re-exported at the bottom
so that callers write ``_cuda.graph_instantiate`` like every other call). This module holds the
rest: errors, start-up, handle accounting, device and context, memory, streams, events.
"""

from __future__ import annotations

import logging
import sys
import threading
import warnings
from collections import Counter

import cuda.bindings
from cuda.bindings import driver as drv

try:
    from cuda.bindings import utils as _utils
except ImportError:  # cuda-bindings 12.8 has no utils module
    _utils = None

from cgraw._cuda import defer, compat as _cuda_compat
from cgraw.errors import (
    CaptureError,
    CudaError,
    CudaUnavailableError,
    OutOfMemoryError,
    ResourceLeakWarning,
)

log = logging.getLogger("cgraw")

_compat = _cuda_compat.select(drv, _utils, getattr(cuda.bindings, "__version__", "0"))

CUresult = drv.CUresult
_R = CUresult

# The codes users of a capture library actually meet, with their usual cause.
_HINTS: dict[int, str] = {
    _R.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: (
        "an operation that cannot be captured ran during the capture (a host synchronisation such as "
        ".item(), .cpu(), .get() or printing a device value, a synchronous copy, cudaMalloc/cudaFree, or "
        "an event query); the capture must be ended and retried without it"
    ),
    _R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: (
        "this operation is not permitted while a stream is capturing (synchronisation, allocation, "
        "event query, or work on the legacy default stream)"
    ),
    _R.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: (
        "the legacy default stream was used while a blocking stream was capturing; run the work on the "
        "capture stream (cgraw makes it torch's and CuPy's current stream)"
    ),
    _R.CUDA_ERROR_STREAM_CAPTURE_UNJOINED: (
        "work was forked to a side stream during capture and never joined back; record an event on the "
        "side stream and make the capture stream wait on it before the capture ends"
    ),
    _R.CUDA_ERROR_STREAM_CAPTURE_ISOLATION: (
        "a dependency crossed the capture boundary: a captured stream waited on an event recorded "
        "outside the capture"
    ),
    _R.CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD: (
        "a capture must be ended on the thread that began it (or use mode='relaxed')"
    ),
    _R.CUDA_ERROR_STREAM_CAPTURE_MERGE: "two independent captures were merged through an event wait",
    _R.CUDA_ERROR_CAPTURED_EVENT: (
        "an event recorded inside a capture was queried or synchronised; such events exist only in the graph"
    ),
    _R.CUDA_ERROR_NOT_PERMITTED: "the operation is not permitted while a stream is capturing",
    _R.CUDA_ERROR_OUT_OF_MEMORY: "device memory is exhausted; free memory, lower the batch, or set a pool limit",
    _R.CUDA_ERROR_INVALID_CONTEXT: "no CUDA context is current on this thread; call cgraw.Device(n).set_current()",
    _R.CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE: (
        "the new graph's topology or node types differ from the executable's; re-instantiate instead"
    ),
    _R.CUDA_ERROR_NOT_INITIALIZED: "the CUDA driver was not initialised; cgraw calls cuInit on first use",
}

# The codes that mean a stream capture failed (they raise ``CaptureError``).
CAPTURE_CODES = frozenset(
    int(c)
    for c in (
        _R.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
        _R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
        _R.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
        _R.CUDA_ERROR_STREAM_CAPTURE_UNJOINED,
        _R.CUDA_ERROR_STREAM_CAPTURE_ISOLATION,
        _R.CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD,
        _R.CUDA_ERROR_STREAM_CAPTURE_MERGE,
        _R.CUDA_ERROR_STREAM_CAPTURE_UNMATCHED,
        _R.CUDA_ERROR_CAPTURED_EVENT,
        _R.CUDA_ERROR_NOT_PERMITTED,
        _R.CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE,
    )
)


def make_error(err, call: str) -> CudaError:
    """Build the exception for a failed driver call (never raises itself)."""
    code = int(err)
    try:
        name = CUresult(code).name
    except ValueError:
        name = f"CUresult({code})"
    description = ""
    try:
        e, s = drv.cuGetErrorString(CUresult(code))  # 12.8 takes no int
        if e == 0 and s:
            description = s.decode() if isinstance(s, bytes) else str(s)
    except Exception:  # the driver may be unloadable; the name is enough then
        pass
    hint = _HINTS.get(code, "")
    if code == _R.CUDA_ERROR_OUT_OF_MEMORY:
        return OutOfMemoryError(call, code, name, description, hint)
    cls = CaptureError if code in CAPTURE_CODES else CudaError
    return cls(call, code, name, description, hint)


def check(result, call: str):
    """Check a cuda-bindings ``(err, *values)`` tuple.

    Returns None, the single value, or the tuple of values. Raises ``CudaError`` (or a subclass)
    naming ``call``.
    """
    if result[0]:
        raise make_error(result[0], call)
    n = len(result)
    if n == 1:
        return None
    if n == 2:
        return result[1]
    return result[1:]


# --------------------------------------------------------------------------- driver start-up

_init_lock = threading.Lock()
_init_error: CudaUnavailableError | None = None
_initialised = False


def init() -> None:
    """Initialise the driver once; raise ``CudaUnavailableError`` if there is none or no device."""
    global _initialised, _init_error
    if _initialised:
        return
    with _init_lock:
        if _initialised:
            return
        if _init_error is not None:
            raise _init_error
        try:
            (err,) = drv.cuInit(0)
        except RuntimeError as exc:  # no libcuda (cuda.pathfinder.DynamicLibNotFoundError; 12.8: dlopen)
            _init_error = CudaUnavailableError(
                f"no CUDA driver found on this machine (libcuda could not be loaded: {exc}); "
                "cgraw needs an NVIDIA GPU and driver"
            )
            raise _init_error from exc
        if err == _R.CUDA_ERROR_NO_DEVICE:
            _init_error = CudaUnavailableError("a CUDA driver is installed but no CUDA device was found")
            raise _init_error
        check((err,), "cuInit")
        n = check(drv.cuDeviceGetCount(), "cuDeviceGetCount")
        if n == 0:
            _init_error = CudaUnavailableError("a CUDA driver is installed but no CUDA device was found")
            raise _init_error
        _initialised = True


def driver_available() -> tuple[bool, str]:
    """Return ``(True, "")`` when a driver and a device are usable, else ``(False, reason)``."""
    try:
        init()
    except CudaUnavailableError as exc:
        return False, str(exc)
    return True, ""


# --------------------------------------------------------------------------- handle accounting

# Live handles created by cgraw, per kind; tests compare them before and after.
live_handles: Counter = Counter()


_DESTROY = {"stream": "cuStreamDestroy", "event": "cuEventDestroy", "mem": "cuMemFree",
            "host": "cuMemFreeHost", "graph": "cuGraphDestroy", "graph_exec": "cuGraphExecDestroy"}


def destroy_quietly(kind: str, handle) -> None:
    """Destroy a handle of ``kind`` (stream, event, mem, host, graph, graph_exec) from a finalizer:
    never raises.

    While any cgraw capture routes allocations the destroy waits for it to end (``defer``).
    During interpreter shutdown every error is ignored. Otherwise a failure becomes a
    ``ResourceLeakWarning`` (the test suite turns it into an error).
    """
    defer.release(_destroy_now, getattr(drv, _DESTROY[kind]), handle, kind)


def stream_handle(ptr: int):
    """The driver's handle for a raw stream pointer (0: legacy, 2: per-thread)."""
    return drv.CUstream(ptr)


def ctx_get_device() -> int:
    return int(check(drv.cuCtxGetDevice(), "cuCtxGetDevice"))


def _destroy_now(fn, handle, kind: str) -> None:
    try:
        if sys.is_finalizing():
            return
        (err,) = fn(handle)
        live_handles[kind] -= 1
        if err:
            warnings.warn(
                ResourceLeakWarning(f"{fn.__name__} failed for a {kind}: {make_error(err, fn.__name__)}"),
                stacklevel=2,
            )
    except Exception as exc:  # a finalizer must never raise
        if not sys.is_finalizing():
            try:
                warnings.warn(ResourceLeakWarning(f"destroying a {kind} raised {exc!r}"), stacklevel=2)
            except Exception:
                pass


def native(handle) -> int:
    """The integer value of a driver handle object (or of an int)."""
    if isinstance(handle, int):
        return handle
    return int(_compat.native_handle(handle))


# --------------------------------------------------------------------------- device and context

def device_get(ordinal: int):
    init()
    return check(drv.cuDeviceGet(ordinal), "cuDeviceGet")


def device_get_count() -> int:
    init()
    return check(drv.cuDeviceGetCount(), "cuDeviceGetCount")


def device_get_name(dev) -> str:
    name = check(drv.cuDeviceGetName(256, dev), "cuDeviceGetName")
    return name.split(b"\0", 1)[0].decode()


def device_primary_ctx_retain(dev):
    return check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")


def ctx_set_current(ctx) -> None:
    check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def ctx_get_current():
    return check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")


def ctx_synchronize() -> None:
    check(drv.cuCtxSynchronize(), "cuCtxSynchronize")


def driver_get_version() -> int:
    init()
    return check(drv.cuDriverGetVersion(), "cuDriverGetVersion")


def mem_get_info() -> tuple[int, int]:
    free, total = check(drv.cuMemGetInfo(), "cuMemGetInfo")
    return int(free), int(total)


# --------------------------------------------------------------------------- memory

def mem_alloc(nbytes: int) -> int:
    ptr = check(drv.cuMemAlloc(nbytes), "cuMemAlloc")
    live_handles["mem"] += 1
    return int(ptr)


def mem_free(ptr: int) -> None:
    check(drv.cuMemFree(ptr), "cuMemFree")
    live_handles["mem"] -= 1


MEMHOSTALLOC_PORTABLE = 1  # CU_MEMHOSTALLOC_PORTABLE: pinned for every context, as CuPy's own staging


def mem_host_alloc(nbytes: int, flags: int = MEMHOSTALLOC_PORTABLE) -> int:
    """Page-locked host memory (``cuMemHostAlloc``); never call it while a capture routes allocations."""
    ptr = check(drv.cuMemHostAlloc(nbytes, flags), "cuMemHostAlloc")
    live_handles["host"] += 1
    return int(ptr)


def mem_free_host(ptr: int) -> None:
    check(drv.cuMemFreeHost(ptr), "cuMemFreeHost")
    live_handles["host"] -= 1


def memcpy_htod(dst: int, src_host_ptr: int, nbytes: int) -> None:
    check(drv.cuMemcpyHtoD(dst, src_host_ptr, nbytes), "cuMemcpyHtoD")


def memcpy_dtoh(dst_host_ptr: int, src: int, nbytes: int) -> None:
    check(drv.cuMemcpyDtoH(dst_host_ptr, src, nbytes), "cuMemcpyDtoH")


def memcpy_htod_async(dst: int, src_host_ptr: int, nbytes: int, stream) -> None:
    """Host to device on ``stream``; inside a capture, from pinned memory only (a graph's memcpy node)."""
    check(drv.cuMemcpyHtoDAsync(dst, src_host_ptr, nbytes, stream), "cuMemcpyHtoDAsync")


def memcpy_dtod_async(dst: int, src: int, nbytes: int, stream) -> None:
    check(drv.cuMemcpyDtoDAsync(dst, src, nbytes, stream), "cuMemcpyDtoDAsync")


# --------------------------------------------------------------------------- streams and events

STREAM_NON_BLOCKING = int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
EVENT_DISABLE_TIMING = int(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
EVENT_DEFAULT = int(drv.CUevent_flags.CU_EVENT_DEFAULT)


def stream_create(flags: int = STREAM_NON_BLOCKING):
    s = check(drv.cuStreamCreate(flags), "cuStreamCreate")
    live_handles["stream"] += 1
    return s


def stream_synchronize(stream) -> None:
    check(drv.cuStreamSynchronize(stream), "cuStreamSynchronize")


def stream_query(stream) -> bool:
    """True when all work on ``stream`` has completed."""
    (err,) = drv.cuStreamQuery(stream)
    if err == _R.CUDA_ERROR_NOT_READY:
        return False
    check((err,), "cuStreamQuery")
    return True


_host_func_launcher: list = []


def launch_host_func(stream_ptr: int, fn_ptr: int) -> None:
    """Enqueue a host function (a C function pointer taking ``void*``) on a stream; inside a
    capture it becomes a host node of the graph, called on every replay.

    Called through the driver library's own entry point, not ``drv.cuLaunchHostFunc``: that
    binding wraps the function in a trampoline whose data it frees after the first call, so a
    host node replayed a second time would read freed memory (seen as a segfault on the H200)."""
    if not _host_func_launcher:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")  # the driver cuda.bindings has already loaded
        fn = lib.cuLaunchHostFunc
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        _host_func_launcher.append(fn)
    err = _host_func_launcher[0](stream_ptr or None, fn_ptr, None)
    check((CUresult(err),), "cuLaunchHostFunc")


def stream_wait_event(stream, event) -> None:
    check(drv.cuStreamWaitEvent(stream, event, 0), "cuStreamWaitEvent")


def event_create(flags: int = EVENT_DISABLE_TIMING):
    e = check(drv.cuEventCreate(flags), "cuEventCreate")
    live_handles["event"] += 1
    return e


def event_record(event, stream) -> None:
    check(drv.cuEventRecord(event, stream), "cuEventRecord")


def event_query(event) -> bool:
    (err,) = drv.cuEventQuery(event)
    if err == _R.CUDA_ERROR_NOT_READY:
        return False
    check((err,), "cuEventQuery")
    return True


def event_synchronize(event) -> None:
    check(drv.cuEventSynchronize(event), "cuEventSynchronize")


def event_elapsed_time(start, end) -> float:
    return float(check(drv.cuEventElapsedTime(start, end), "cuEventElapsedTime"))


def has_leaf_outside(nodes, edges, deps) -> bool:
    """Whether a graph of ``nodes`` and ``edges`` has a node with no successor but ``deps`` (a
    stream's capture dependencies): work forked to a side stream of a capture, never joined back."""
    has_succ, mine = {native(a) for a, _ in edges}, {native(d) for d in deps}
    return any(native(n) not in has_succ and native(n) not in mine for n in nodes)


# Graph work lives in ``graphs``, which imports the names above from here (hence this import at the
# bottom); these are the ones the rest of cgraw calls as ``_cuda.<name>``.
from cgraw._cuda.graphs import (  # noqa: E402, F401
    CAPTURE_MODES,
    INSTANTIATE_UPLOAD,
    MEMCPY_D2D,
    KernelArgs,
    MemcpyNodeSetter,
    NodeType,
    func_get_name,
    graph_debug_dot_print,
    graph_exec_kernel_node_set_args,
    graph_exec_node_set_enabled,
    graph_exec_update,
    graph_get_edges,
    graph_get_nodes,
    graph_instantiate,
    graph_kernel_node_args,
    graph_kernel_node_get_params,
    graph_launch_raw,
    graph_memcpy_node_dst_src,
    graph_memcpy_node_extent,
    graph_memset_node_extent,
    graph_node_get_type,
    graph_upload,
    kernel_get_name,
    mem_address_range,
    memcpy_node_set_1d_raw,
    rt_node_handle,
    stream_begin_capture,
    stream_capture_graph,
    stream_capture_info,
    stream_end_capture_raw,
    stream_is_capturing,
    thread_exchange_capture_mode,
)

"""The CUDA call layer: the only module that imports ``cuda.bindings``.

Layer L1. Every driver call cgraw makes goes through ``check`` (or, on the hot paths, through a
bound function whose result is compared with 0 inline). Wrappers are the driver call with ``cu``
dropped and the rest in snake_case (``cuStreamBeginCapture`` -> ``stream_begin_capture``). Nothing
here runs at import: the driver is loaded by the first call, and a machine with no driver or no
device gets one ``CudaUnavailableError``. Imports only ``errors``, ``_defer`` and ``_cuda_compat``
(which picks, once, the calls that differ between cuda-bindings 12.8+ and 13.x) from cgraw.
"""

from __future__ import annotations

import logging
import sys
import threading
import warnings
from collections import Counter

import cuda.bindings
from cuda.bindings import driver as drv
from cuda.bindings import runtime as _rt

try:
    from cuda.bindings import utils as _utils
except ImportError:  # cuda-bindings 12.8 has no utils module
    _utils = None

from cgraw import _cuda_compat, _defer
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

_CAPTURE_CODES = frozenset(
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
    cls = CaptureError if code in _CAPTURE_CODES else CudaError
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
            "graph": "cuGraphDestroy", "graph_exec": "cuGraphExecDestroy"}


def destroy_quietly(kind: str, handle) -> None:
    """Destroy a handle of ``kind`` (stream, event, mem, graph, graph_exec) from a finalizer:
    never raises.

    While any cgraw capture routes allocations the destroy waits for it to end (``_defer``).
    During interpreter shutdown every error is ignored. Otherwise a failure becomes a
    ``ResourceLeakWarning`` (the test suite turns it into an error).
    """
    _defer.release(_destroy_now, getattr(drv, _DESTROY[kind]), handle, kind)


def stream_handle(ptr: int):
    """The driver's handle for a raw stream pointer (0: legacy, 2: per-thread)."""
    return drv.CUstream(ptr)


def ctx_get_device() -> int:
    return int(check(drv.cuCtxGetDevice(), "cuCtxGetDevice"))


def kernel_get_name(kern) -> str:
    name = check(drv.cuKernelGetName(kern), "cuKernelGetName")
    return name.decode() if isinstance(name, bytes) else str(name)


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


def memcpy_htod(dst: int, src_host_ptr: int, nbytes: int) -> None:
    check(drv.cuMemcpyHtoD(dst, src_host_ptr, nbytes), "cuMemcpyHtoD")


def memcpy_dtoh(dst_host_ptr: int, src: int, nbytes: int) -> None:
    check(drv.cuMemcpyDtoH(dst_host_ptr, src, nbytes), "cuMemcpyDtoH")


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


# --------------------------------------------------------------------------- capture

CaptureModeEnum = drv.CUstreamCaptureMode
CAPTURE_MODES = {
    "global": CaptureModeEnum.CU_STREAM_CAPTURE_MODE_GLOBAL,
    "thread_local": CaptureModeEnum.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
    "relaxed": CaptureModeEnum.CU_STREAM_CAPTURE_MODE_RELAXED,
}
def stream_begin_capture(stream, mode) -> None:
    check(drv.cuStreamBeginCapture(stream, mode), "cuStreamBeginCapture")


def stream_end_capture_raw(stream):
    """End a capture; returns ``(err, graph_or_None)`` without raising, for clean aborts."""
    err, graph = drv.cuStreamEndCapture(stream)
    if graph is not None and not err:
        live_handles["graph"] += 1
    return err, graph


def stream_is_capturing(stream) -> int:
    """0 = none, 1 = active, 2 = invalidated."""
    return int(check(drv.cuStreamIsCapturing(stream), "cuStreamIsCapturing"))


def stream_capture_info(stream):
    """``(status, capture_id)`` of a stream; version differences of the binding stay here."""
    res = check(_compat.capture_info(stream), "cuStreamGetCaptureInfo")
    return int(res[0]), int(res[1]) if res[1] is not None else 0


def stream_capture_graph(stream):
    """``(graph, dependencies)`` of a stream that is capturing: the graph being built and the
    nodes the stream's next operation would depend on."""
    res = check(_compat.capture_info(stream), "cuStreamGetCaptureInfo")
    return res[2], list(res[3] or [])


def thread_exchange_capture_mode(mode):
    return check(drv.cuThreadExchangeStreamCaptureMode(mode), "cuThreadExchangeStreamCaptureMode")


# --------------------------------------------------------------------------- graphs

INSTANTIATE_UPLOAD = int(drv.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD)

_INSTANTIATE_RESULTS = {  # CUgraphInstantiateResult (1, CUDA_GRAPH_INSTANTIATE_ERROR, has no more to say)
    2: "invalid graph structure (a cycle, or an invalid node)",
    3: "the graph uses node types that device launch does not support",
    4: "the graph has nodes from several contexts",
    5: "a conditional handle of the graph is not used by any conditional node",
}


def graph_instantiate(graph, flags: int = 0, upload_stream=None):
    """Instantiate ``graph``; on failure the error names the reason and the failing node."""
    params = drv.CUDA_GRAPH_INSTANTIATE_PARAMS()
    params.flags = flags
    if upload_stream is not None:
        params.hUploadStream = upload_stream
    err, exec_ = drv.cuGraphInstantiateWithParams(graph, params)
    if err:
        e = make_error(err, "cuGraphInstantiateWithParams")
        reason = _INSTANTIATE_RESULTS.get(int(params.result_out))
        if reason:
            e = CaptureError(e.call, e.code, e.name, e.description, reason)
        raise e
    live_handles["graph_exec"] += 1
    return exec_


def graph_upload(exec_, stream) -> None:
    check(drv.cuGraphUpload(exec_, stream), "cuGraphUpload")


# Bound once for the replay hot path: callers compare the result with 0 inline.
graph_launch_raw = drv.cuGraphLaunch


def graph_exec_update(exec_, graph) -> tuple[bool, str]:
    """Try ``cuGraphExecUpdate``; returns ``(ok, reason)``."""
    err, info = drv.cuGraphExecUpdate(exec_, graph)
    if not err:
        return True, ""
    reason = make_error(err, "cuGraphExecUpdate").name
    if info is not None:
        try:
            reason = info.result.name
        except AttributeError:
            pass
    if err != _R.CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE:
        raise make_error(err, "cuGraphExecUpdate")
    return False, reason


def graph_get_nodes(graph) -> list:
    _, n = check(drv.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")
    if not n:
        return []
    nodes, _ = check(drv.cuGraphGetNodes(graph, n), "cuGraphGetNodes")
    return list(nodes[:n])


def graph_get_edges(graph) -> list[tuple]:
    res = check(_compat.graph_get_edges(graph, 0), "cuGraphGetEdges")
    n = res[-1]
    if not n:
        return []
    res = check(_compat.graph_get_edges(graph, n), "cuGraphGetEdges")
    return list(zip(res[0][:n], res[1][:n]))


def graph_node_get_type(node):
    return check(drv.cuGraphNodeGetType(node), "cuGraphNodeGetType")


def graph_kernel_node_get_params(node):
    return check(drv.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")


def func_get_name(func) -> str:
    name = check(drv.cuFuncGetName(func), "cuFuncGetName")
    return name.decode() if isinstance(name, bytes) else str(name)


def graph_debug_dot_print(graph, path: str, flags: int = 1) -> None:
    check(drv.cuGraphDebugDotPrint(graph, path.encode(), flags), "cuGraphDebugDotPrint")


NodeType = drv.CUgraphNodeType


def graph_memcpy_node_dst_src(node) -> tuple[int, int]:
    """``(dst, src)`` device addresses of a 1-D memcpy node."""
    p = check(drv.cuGraphMemcpyNodeGetParams(node), "cuGraphMemcpyNodeGetParams")
    return int(p.dstDevice), int(p.srcDevice)  # CUdeviceptr is an integer type


# Per-call input copies are memcpy nodes whose pointers are patched before a launch. The runtime's
# 1-D setter takes plain pointers (1.4 us measured on the H200); the driver's takes a CUDA_MEMCPY3D
# that would have to be built in Python on every call. Handles convert once, at record time.
MEMCPY_D2D = _rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
memcpy_node_set_1d_raw = _rt.cudaGraphExecMemcpyNodeSetParams1D


class MemcpyNodeSetter:
    """Re-points memcpy nodes of one executable graph (``Graph.exec_memcpy_setter``): the hot
    path of a graphed call whose eager input moved."""

    __slots__ = ("exec_",)

    def __init__(self, exec_):
        self.exec_ = _rt.cudaGraphExec_t(native(exec_))

    def __call__(self, node, dst: int, src: int, nbytes: int) -> None:
        err = memcpy_node_set_1d_raw(self.exec_, node, dst, src, nbytes, MEMCPY_D2D)[0]
        if err:
            raise rt_error(err, "cudaGraphExecMemcpyNodeSetParams1D")


def rt_node_handle(node):
    return _rt.cudaGraphNode_t(native(node))


def rt_error(err, call: str) -> CudaError:
    """A runtime-API failure, reported like a driver one."""
    name = getattr(err, "name", str(err))
    hint = "the graph's memcpy node could not take the new pointer (different allocation or size?)"
    return CudaError(call, int(err), name, "", hint)

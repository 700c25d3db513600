"""Graph work through the driver: stream capture, instantiate, upload, update, launch, node queries.

Layer L1, part of the CUDA call layer (``cgraw._cuda`` re-exports every name here that the rest of
cgraw calls, so callers keep writing ``_cuda.graph_instantiate``). Split from the package's
``__init__`` (errors, start-up, handles, device, memory, streams, events) only to keep both small:
the same rules hold, every call goes through ``check`` or, on the replay hot paths
(``graph_launch_raw``, ``memcpy_node_set_1d_raw``), is a bound function whose result the caller
compares with 0 inline. The version-dependent calls go through the package's ``_compat``.
"""

from __future__ import annotations

from cuda.bindings import driver as drv
from cuda.bindings import runtime as _rt

from cgraw._cuda import _R, _compat, check, live_handles, make_error, native
from cgraw.errors import CaptureError, CudaError

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


def graph_kernel_node_args(node) -> tuple[object, list[tuple[int, bytes]] | None]:
    """A kernel node's ``CUDA_KERNEL_NODE_PARAMS`` and its arguments' bytes by parameter index
    (sizes from ``cuFuncGetParamInfo``). None instead of the list when the node was launched with
    ``extra`` (one packed buffer) instead of ``kernelParams``: its arguments cannot be read."""
    import ctypes

    p = graph_kernel_node_get_params(node)
    func = p.func
    if int(func) == 0 and int(p.kern) != 0:
        func = check(drv.cuKernelGetFunction(p.kern), "cuKernelGetFunction")
    table = int(p.kernelParams)
    if not table:
        return p, None if int(p.extra) else []
    args: list[tuple[int, bytes]] = []
    i = 0
    while True:
        err, _offset, size = drv.cuFuncGetParamInfo(func, i)
        if err != 0:  # past the last parameter
            break
        value = ctypes.c_void_p.from_address(table + 8 * i).value
        args.append((i, ctypes.string_at(value, int(size))))
        i += 1
    return p, args


_set_kernel_params = drv.cuGraphExecKernelNodeSetParams


class KernelArgs:
    """One kernel node of one executable graph, its arguments in buffers cgraw owns: ``word``
    gives a writable view of an 8-byte argument word, and calling the object hands the buffers to
    the executable (``cuGraphExecKernelNodeSetParams``; the driver copies them). Built once at
    record time; the call is the hot path of a graphed call whose rebound input moved (1.48 us
    per node measured on the H200 by ``tools/probes/rebind_probe.py``)."""

    __slots__ = ("exec_", "node", "q", "bufs", "table")

    def __init__(self, exec_, node, params, args: list[bytes]):
        import ctypes

        self.exec_, self.node = exec_, node
        self.bufs = [ctypes.create_string_buffer(bytes(a), max(len(a), 1)) for a in args]
        self.table = (ctypes.c_void_p * max(len(self.bufs), 1))(*[ctypes.addressof(b) for b in self.bufs])
        q = drv.CUDA_KERNEL_NODE_PARAMS()
        if int(params.func) != 0:
            q.func = params.func
        else:  # captured as a CUkernel (library-loaded module)
            q.kern = params.kern
            q.ctx = params.ctx
        q.gridDimX, q.gridDimY, q.gridDimZ = params.gridDimX, params.gridDimY, params.gridDimZ
        q.blockDimX, q.blockDimY, q.blockDimZ = params.blockDimX, params.blockDimY, params.blockDimZ
        q.sharedMemBytes = params.sharedMemBytes
        q.kernelParams = ctypes.addressof(self.table)
        self.q = q

    def word(self, param: int, offset: int):
        """A ``ctypes.c_uint64`` over bytes ``offset..offset+8`` of argument ``param``."""
        import ctypes

        return ctypes.c_uint64.from_address(ctypes.addressof(self.bufs[param]) + offset)

    def __call__(self) -> None:
        (err,) = _set_kernel_params(self.exec_, self.node, self.q)
        if err:
            raise make_error(err, "cuGraphExecKernelNodeSetParams")


def graph_exec_kernel_node_set_args(exec_, node, params, args: list[bytes]) -> None:
    """Give ``node`` of ``exec_`` the arguments ``args`` (bytes by parameter index), the rest of
    ``params`` (function, grid, block, shared memory) unchanged."""
    KernelArgs(exec_, node, params, args)()


def graph_memcpy_node_extent(node) -> tuple[int, int, int] | None:
    """``(dst, src, bytes)`` of a 1-D device memcpy node; None for any other shape."""
    p = check(drv.cuGraphMemcpyNodeGetParams(node), "cuGraphMemcpyNodeGetParams")
    if int(p.Height) > 1 or int(p.Depth) > 1 or int(p.srcXInBytes) or int(p.dstXInBytes):
        return None
    return int(p.dstDevice), int(p.srcDevice), int(p.WidthInBytes)


def graph_memset_node_extent(node) -> tuple[int, int]:
    """``(dst, bytes spanned)`` of a memset node."""
    p = check(drv.cuGraphMemsetNodeGetParams(node), "cuGraphMemsetNodeGetParams")
    rows = max(int(p.height), 1)
    return int(p.dst), int(p.pitch) * (rows - 1) + int(p.elementSize) * int(p.width)


def graph_exec_node_set_enabled(exec_, node, enabled: bool) -> None:
    """Enable or disable ``node`` (a driver or runtime node handle) in the executable ``exec_``."""
    check(drv.cuGraphNodeSetEnabled(exec_, drv.CUgraphNode(native(node)), 1 if enabled else 0),
          "cuGraphNodeSetEnabled")


def mem_address_range(ptr: int) -> tuple[int, int] | None:
    """``(base, size)`` of the driver allocation holding ``ptr``, or None if it is not device memory."""
    err, base, size = drv.cuMemGetAddressRange(ptr)
    if err:
        return None
    return int(base), int(size)


def func_get_name(func) -> str:
    name = check(drv.cuFuncGetName(func), "cuFuncGetName")
    return name.decode() if isinstance(name, bytes) else str(name)


def kernel_get_name(kern) -> str:
    name = check(drv.cuKernelGetName(kern), "cuKernelGetName")
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

"""Conditional graph nodes through the driver: handles, WHILE and IF nodes, capture into a body.

Layer L1, part of the CUDA call layer (``cgraw._cuda`` re-exports the names callers use). Every
call goes through ``check``. The calls whose signature differs between cuda-bindings 12.x and 13.x
(``cuGraphAddNode`` and ``cuStreamUpdateCaptureDependencies`` take edge data in 13.x only) go
through the package's ``_compat``.

A node joins a running capture as in CUDA's ``graphConditionalNodes`` sample, cuda.core's
``GraphBuilder``, PyTorch's ``CUDAGraph::begin_capture_to_if_node`` and CuPy's
``_append_conditional_node_to_stream``: ``cuGraphAddNode`` on the capture's graph after the
stream's capture dependencies (``cuStreamGetCaptureInfo``), then
``cuStreamUpdateCaptureDependencies`` so that the stream's next work follows the node.

A conditional node's body graphs belong to the node (the driver destroys them with the parent
graph), so the graphs these functions hand out are never counted in ``live_handles``; nor is the
parent graph a capture pauses and resumes (``stream_end_capture_into``): the outer capture still
owns it. ``cuda.bindings`` fills ``phGraph_out`` in ``cuGraphAddNode`` (cuda.core reads it the same
way); before that call the field is a null pointer, and reading it with ``size`` set crashes the
process. ``cgraw.control.nodes`` composes them; ``cgraw.control.plan`` decides which to use.
"""

from __future__ import annotations

import ctypes

from cuda.bindings import driver as drv

from cgraw._cuda import _compat, check, make_error

COND_IF = drv.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_IF
COND_WHILE = drv.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE
COND_TYPES = {"if": COND_IF, "while": COND_WHILE}
SET_CAPTURE_DEPENDENCIES = drv.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES


def conditional_handle_value(handle) -> int:
    """The 64-bit value of a ``CUgraphConditionalHandle`` (the set-condition kernel's argument).
    ``get_cuda_native_handle`` does not know the type, and ``int()`` of binding objects is deprecated."""
    if isinstance(handle, int):
        return handle
    return int(ctypes.c_uint64.from_address(int(handle.getPtr())).value)


def graph_conditional_handle_create(graph, ctx, default: int = 0, flags: int = 0):
    """A condition handle of ``graph`` (``cuGraphConditionalHandleCreate``); with ``flags`` 0 its
    value is only what the set-condition kernels write."""
    return check(drv.cuGraphConditionalHandleCreate(graph, ctx, default, flags), "cuGraphConditionalHandleCreate")


def graph_add_conditional_node(graph, deps: list, handle, kind: str, size: int, ctx) -> tuple[object, list]:
    """Add a conditional node of ``kind`` (``"if"`` or ``"while"``) with ``size`` bodies to
    ``graph`` after ``deps``; returns ``(node, body graphs)``."""
    p = drv.CUgraphNodeParams()
    p.type = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
    p.conditional.handle = handle
    p.conditional.type = COND_TYPES[kind]
    p.conditional.size = size
    p.conditional.ctx = ctx
    deps = list(deps or [])
    node = check(_compat.graph_add_node(graph, deps, len(deps), p), "cuGraphAddNode")
    bodies = list(p.conditional.phGraph_out)[:size]
    return node, bodies


def stream_set_capture_dependencies(stream, nodes: list) -> None:
    """Make ``nodes`` the capture dependencies of ``stream`` (``CU_STREAM_SET_CAPTURE_DEPENDENCIES``):
    the stream's next captured work follows them, as after a node added to its graph by hand."""
    nodes = list(nodes)
    check(_compat.update_capture_dependencies(stream, nodes, len(nodes), SET_CAPTURE_DEPENDENCIES),
          "cuStreamUpdateCaptureDependencies")


def stream_begin_capture_to_graph(stream, graph, deps: list, mode) -> None:
    """Capture ``stream`` into the existing ``graph``, its first node after ``deps``."""
    deps = list(deps or [])
    check(drv.cuStreamBeginCaptureToGraph(stream, graph, deps or None, None, len(deps), mode),
          "cuStreamBeginCaptureToGraph")


def stream_end_capture_into(stream):
    """End a capture whose graph someone else owns (a body, or an outer capture that pauses while
    its stream captures a body, and then resumes); returns the graph. Raises ``CaptureError`` (or ``CudaError``) naming ``cuStreamEndCapture``."""
    err, graph = drv.cuStreamEndCapture(stream)
    if err:
        raise make_error(err, "cuStreamEndCapture")
    return graph

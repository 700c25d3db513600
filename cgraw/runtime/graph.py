"""Executable CUDA graphs: instantiate, replay, inspect, update.

Layer L6: imports ``_cuda``, ``device`` and ``stream``; knows nothing of torch, CuPy or the
capture context manager (``capture`` builds Graphs). ``Graph.replay`` is the hot path: the
caller's current stream (``stream.current_ptr``) and one driver call; a graph that draws random
numbers first runs its generators' step (``rng.plan.GraphRng.sync``: no driver call unless a
generator moved outside the graphs).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from cgraw import _cuda
from cgraw.runtime import stream as _streams
from cgraw.runtime.device import Device
from cgraw.errors import CaptureError, CgrawError
from cgraw.runtime.stream import Stream, stream_ptr

_NODE_TYPE_NAMES = {int(v): v.name.replace("CU_GRAPH_NODE_TYPE_", "") for v in _cuda.NodeType}
_KERNEL = int(_cuda.NodeType.CU_GRAPH_NODE_TYPE_KERNEL)
_launch = _cuda.graph_launch_raw


@dataclass(frozen=True)
class NodeInfo:
    """One node of a graph. Kernel fields are None for other node types."""

    index: int
    type: str
    kernel: str | None = None
    grid: tuple[int, int, int] | None = None
    block: tuple[int, int, int] | None = None
    shared_mem: int | None = None
    handle: int = 0
    depends_on: tuple[int, ...] = ()
    condition: str | None = None  # a conditional node's kind ("while", "if"), when its capture noted it
    bodies: tuple = ()  # a conditional node's body graphs, each a tuple of NodeInfo


def _destroy_pair(exec_, graph) -> None:
    """Finalizer: destroy an executable graph and its graph. Never raises."""
    if exec_ is not None:
        _cuda.destroy_quietly("graph_exec", exec_)
    if graph is not None:
        _cuda.destroy_quietly("graph", graph)


class Graph:
    """A captured, instantiated CUDA graph.

    Build one with ``cgraw.capture()``. ``replay()`` launches it on the caller's current stream:
    torch's current stream (``with torch.cuda.stream(s):``) when it is not the default one, else
    CuPy's current stream, else the legacy default stream, as ``torch.cuda.CUDAGraph.replay()``
    does. ``stream=`` picks another one.
    """

    __slots__ = (
        "device",
        "_ordinal",
        "pool",
        "capture_stream",
        "_graph",
        "_exec",
        "_finalizer",
        "_keepalive",
        "_nodes",
        "_bodies",
        "num_nodes",
        "capture_ms",
        "instantiate_ms",
        "rng",
        "_rng_sync",
        "__weakref__",
    )

    def __init__(self, *args, **kwargs):
        raise TypeError("Graph objects come from cgraw.capture()")

    @classmethod
    def _pending(cls, device: Device, pool, capture_stream: Stream) -> "Graph":
        self = object.__new__(cls)
        self.device = device
        self._ordinal = device.ordinal
        self.pool = pool
        self.capture_stream = capture_stream
        self._graph = None
        self._exec = None
        self._finalizer = None
        self._keepalive = []
        self._nodes = None
        self._bodies = {}  # a conditional node's handle -> (its kind, its body graphs)
        self.num_nodes = 0
        self.capture_ms = 0.0
        self.instantiate_ms = 0.0
        self.rng = None  # random numbers drawn in the graph: generators, draws (rng.plan.GraphRng)
        self._rng_sync = None  # rng.plan.GraphRng.sync, run before each launch
        return self

    def _finish(self, cugraph, *, flags: int = 0, upload: bool = True) -> None:
        """Instantiate the captured ``cugraph`` (and upload it), taking ownership of both."""
        self._graph = cugraph
        self._finalizer = weakref.finalize(self, _destroy_pair, None, cugraph)
        try:
            if upload:
                exec_ = _cuda.graph_instantiate(
                    cugraph, flags | _cuda.INSTANTIATE_UPLOAD, self.capture_stream.handle
                )
            else:
                exec_ = _cuda.graph_instantiate(cugraph, flags)
        except BaseException:
            self.close()
            raise
        self._finalizer.detach()
        self._exec = exec_
        self._finalizer = weakref.finalize(self, _destroy_pair, exec_, cugraph)
        self.num_nodes = len(_cuda.graph_get_nodes(cugraph))
        register = getattr(self.pool, "_register_graph", None)
        if register is not None:
            register(self)  # the pool keeps this graph's memory from eager allocations

    # ------------------------------------------------------------------ hot path

    def replay(self, stream=None) -> None:
        """Launch the graph on ``stream`` (default: the caller's current stream, see the class)."""
        exec_ = self._exec
        if exec_ is None:
            raise CgrawError("replay of a closed cgraw.Graph; capture it again")
        if stream is None:
            ptr = _streams.current_getter(self._ordinal)
        elif stream.__class__ is Stream:
            if stream.device is not self.device:
                raise CgrawError(
                    f"replay on a stream of device {stream.device.ordinal}, but the graph was "
                    f"captured on device {self.device.ordinal}"
                )
            ptr = stream.ptr
        else:
            ptr = stream_ptr(stream)
        sync = self._rng_sync
        if sync is not None:
            sync(ptr)
        (err,) = _launch(exec_, ptr)
        if err:
            self.launch_failed(err, ptr)

    def launch_failed(self, err, ptr: int) -> None:
        """After a launch on ``ptr`` returned ``err`` (also for a caller that inlines ``replay``):
        recover or raise. A launch on the legacy or per-thread stream uses the thread's current
        context: after another device was made current, make the graph's current and try once
        more. A launch that fails leaves its generator records unknown to the host (the next
        replay writes them)."""
        if ptr in (0, 1, 2):
            self.device.set_current()
            (err,) = _launch(self._exec, ptr)
            if not err:
                return
        if self.rng is not None:
            self.rng.forget()
        raise _cuda.make_error(err, "cuGraphLaunch")

    __call__ = replay

    def _set_rng(self, rng) -> None:
        """The random numbers the graph draws (``rng.plan.GraphRng``), or None."""
        self.rng = rng
        self._rng_sync = None if rng is None else rng.sync

    # ------------------------------------------------------------------ for graph trees

    def memcpy_nodes(self) -> dict:
        """``(dst, src) -> node`` for every 1-D memcpy node, the node as the runtime handle that
        ``exec_memcpy_setter`` patches."""
        self._require_open()
        kind = int(_cuda.NodeType.CU_GRAPH_NODE_TYPE_MEMCPY)
        return {_cuda.graph_memcpy_node_dst_src(h): _cuda.rt_node_handle(h)
                for h in _cuda.graph_get_nodes(self._graph) if int(_cuda.graph_node_get_type(h)) == kind}

    def exec_handle(self):
        """The executable's driver handle, for a caller that inlines ``replay`` (graph trees):
        ``_cuda.graph_launch_raw(handle, stream_ptr)``. Valid until ``close()``."""
        self._require_open()
        return self._exec

    def exec_memcpy_setter(self):
        """``set(node, dst, src, nbytes)``: re-point a memcpy node of this executable (from
        ``memcpy_nodes``) for later launches, one ``cudaGraphExecMemcpyNodeSetParams1D``."""
        self._require_open()
        return _cuda.MemcpyNodeSetter(self._exec)

    # ------------------------------------------------------------------ management

    def upload(self, stream=None) -> None:
        """Upload the executable to the device ahead of the first replay."""
        self._require_open()
        s = self.capture_stream if stream is None else Stream.of(stream, self.device)
        _cuda.graph_upload(self._exec, s.handle)

    def close(self) -> None:
        """Destroy the executable and the graph (idempotent). The pool stays with its other users.
        Inside a capture the destroy waits until no capture routes allocations (``cgraw._cuda.defer``)."""
        self._exec = None
        self._graph = None
        self._keepalive = []
        self._set_rng(None)
        unregister = getattr(self.pool, "_unregister_graph", None)
        if unregister is not None:
            unregister(self)
        if self._finalizer is not None:
            self._finalizer()

    @property
    def closed(self) -> bool:
        """True when the graph holds no executable (after ``close()``)."""
        return self._exec is None

    def update_from(self, other: "Graph") -> None:
        """Take ``other``'s node parameters with ``cuGraphExecUpdate`` (same topology required).

        Later replays of this graph run ``other``'s work (its pointers, its kernels' arguments).
        This graph keeps ``other``'s pool alive from then on.
        """
        self._require_open()
        other._require_open()
        if other.device is not self.device:
            raise CaptureError(
                "cuGraphExecUpdate", 0, "DEVICE_MISMATCH",
                f"cannot update a graph of device {self.device.ordinal} from one of device {other.device.ordinal}",
            )
        ok, reason = _cuda.graph_exec_update(self._exec, other._graph)
        if not ok:
            raise CaptureError(
                "cuGraphExecUpdate",
                int(_cuda.CUresult.CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE),
                "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE",
                f"the graphs differ ({reason}); this graph has {self.num_nodes} nodes, the other "
                f"{other.num_nodes}",
                "update_from needs the same topology and node types; capture again or instantiate the other graph",
            )
        self._keepalive.append(other.pool)
        self._set_rng(other.rng)  # its kernels draw as the other graph's do
        self._nodes = None

    def _require_open(self) -> None:
        if self._exec is None:
            raise CgrawError("this cgraw.Graph is closed")

    # ------------------------------------------------------------------ inspection

    def node_handles(self) -> list:
        """The graph's driver node handles, in ``cuGraphGetNodes`` order (``nodes()``'s indices)."""
        self._require_open()
        return _cuda.graph_get_nodes(self._graph)

    def nodes(self) -> list[NodeInfo]:
        """Every node with its type and, for kernels, name, grid, block and dynamic shared memory;
        for a conditional node (``cgraw.while_loop``, ``cgraw.cond``), its kind and the nodes of
        its body graphs."""
        self._require_open()
        if self._nodes is None:
            self._nodes = _node_infos(self._graph, self._bodies)
        return self._nodes

    def note_conditional(self, node, kind: str, bodies: list) -> None:
        """Remember a conditional node the capture added (``cgraw.control``): its kind and its
        body graphs, which the parent graph owns (``nodes()`` and ``print`` show them)."""
        self._bodies[_cuda.native(node)] = (kind, list(bodies))

    def summary(self, width: int = 76) -> str:
        """A readable table of the nodes, one box per node, in the driver's node order; a
        conditional node's bodies follow it, their boxes indented."""
        lines = [f"cgraw.Graph on device {self.device.ordinal}: {self.num_nodes} node(s)"]
        _boxes(self.nodes(), width, "", lines)
        return "\n".join(lines)

    def __str__(self) -> str:
        if self._exec is None:
            return "cgraw.Graph (closed)"
        return self.summary()

    def __repr__(self) -> str:
        state = "closed" if self._exec is None else f"{self.num_nodes} nodes"
        return f"<cgraw.Graph device={self.device.ordinal} {state}>"

    def to_dot(self, path: str, *, verbose: bool = True) -> str:
        """Write the graph in Graphviz format with ``cuGraphDebugDotPrint``; returns ``path``."""
        self._require_open()
        flags = 1 if verbose else 0
        _cuda.graph_debug_dot_print(self._graph, str(path), flags)
        return str(path)


def _node_infos(graph, bodies: dict) -> list[NodeInfo]:
    """``NodeInfo`` of every node of ``graph``; ``bodies``: conditional nodes' kinds and body graphs
    by handle (``Graph.note_conditional``)."""
    handles = _cuda.graph_get_nodes(graph)
    index = {_cuda.native(h): i for i, h in enumerate(handles)}
    deps: dict[int, list[int]] = {}
    for src, dst in _cuda.graph_get_edges(graph):
        deps.setdefault(index[_cuda.native(dst)], []).append(index[_cuda.native(src)])
    out = []
    for i, h in enumerate(handles):
        t = int(_cuda.graph_node_get_type(h))
        info = dict(index=i, type=_NODE_TYPE_NAMES.get(t, str(t)), handle=_cuda.native(h),
                    depends_on=tuple(sorted(deps.get(i, ()))))
        if t == _KERNEL:
            p = _cuda.graph_kernel_node_get_params(h)
            info.update(
                kernel=_kernel_name(p),
                grid=(int(p.gridDimX), int(p.gridDimY), int(p.gridDimZ)),
                block=(int(p.blockDimX), int(p.blockDimY), int(p.blockDimZ)),
                shared_mem=int(p.sharedMemBytes),
            )
        noted = bodies.get(info["handle"])
        if noted is not None:
            info.update(condition=noted[0], bodies=tuple(tuple(_node_infos(b, bodies)) for b in noted[1]))
        out.append(NodeInfo(**info))
    return out


def _boxes(nodes, width: int, indent: str, lines: list) -> None:
    """One box per node into ``lines``, ``indent`` before each; a conditional node's bodies after it."""
    inner = width - 4
    for n in nodes:
        kind = (n.condition or "").upper()
        if kind == "IF" and len(n.bodies) == 2:
            kind = "IF/ELSE"
        box = [f"NODE {n.index}: {n.type}" + (f" ({kind})" if kind else "")]
        if n.kernel is not None:
            first = inner - 8
            box.append("Kernel: " + n.kernel[:first])
            for i in range(first, len(n.kernel), inner - 2):
                box.append("  " + n.kernel[i : i + inner - 2])
            box.append(f"<<<{_dim(n.grid)},{_dim(n.block)},{n.shared_mem}>>>")
        box.append(f"Node handle: 0x{n.handle:016X}")
        if n.depends_on:
            box.append("after: " + ", ".join(f"NODE {d}" for d in n.depends_on))
        for b, body in enumerate(n.bodies):
            box.append(f"body {b}: {len(body)} node(s), below")
        lines.append(indent + "+" + "-" * (width - 2) + "+")
        lines.extend(f"{indent}| {b[:inner]:<{inner}} |" for b in box)
        lines.append(indent + "+" + "-" * (width - 2) + "+")
        for b, body in enumerate(n.bodies):
            lines.append(f"{indent}    body {b} of NODE {n.index}:")
            _boxes(body, width, indent + "    ", lines)


def _dim(d) -> str:
    x, y, z = d
    if y == 1 and z == 1:
        return str(x)
    return f"{{{x},{y},{z}}}" if z != 1 else f"{{{x},{y}}}"


def _kernel_name(params) -> str:
    try:
        if _cuda.native(params.func):
            return _cuda.func_get_name(params.func)
    except CgrawError:
        pass
    try:
        return _cuda.kernel_get_name(params.kern)
    except CgrawError:
        return "<unknown kernel>"

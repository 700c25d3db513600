"""A fake of the ``cgraw._cuda`` functions the capture path of ``cgraw.while_loop`` and
``cgraw.cond`` calls (``cgraw.control.nodes``), for the CPU tier: it records each driver call and
which graph the capture stream captures into, and stands in for a running ``cgraw.capture()``.
Arrays are CPU torch tensors (device ordinal -1): the captured work runs once, on the host, while
the fake "captures" it. ``tests/unit/test_control_flow_cpu.py`` asserts the call sequences;
``tests/unit/test_control_flow_emulated_cpu.py`` replays what was captured."""

from __future__ import annotations

import types

from cgraw import _cuda
from cgraw._cuda import conditional as _cond, kernels as _k
from cgraw.control import kernels as K
from cgraw.rng import kernels as RK, plan as rng
from cgraw.runtime import capture as _capture


class FakeDriver:
    """The ``_cuda`` functions the capture path calls (set with ``monkeypatch``), recording each
    call in ``calls`` and the graph the stream captures into in ``capturing``."""

    def __init__(self, monkeypatch, version=12080, body_types=("KERNEL",), unjoined=False):
        self.calls: list[tuple] = []
        self.capturing = "G"  # the outer capture's graph
        self.deps = {"G": ["n0"]}
        self.handles = 0
        self.nodes = 0
        # the capture's random-number streams (rng.plan.RngStream): a test draws by taking offsets
        self.rngs = [rng.RngStream(0x5000, -1, 0, rng.TORCH), rng.RngStream(0x6000, -1, 0, rng.CUPY)]
        self.body_types = body_types
        self.unjoined = unjoined  # the outer graph has a leaf of a side stream not joined back
        dev = types.SimpleNamespace(ordinal=-1, context="ctx")
        self.noted = []  # (node, kind, body graphs) the capture path told the graph of
        self.cap = types.SimpleNamespace(graph=types.SimpleNamespace(
            device=dev, capture_stream=types.SimpleNamespace(handle="S"),
            note_conditional=lambda node, kind, bodies: self.noted.append((node, kind, list(bodies)))),
            mode="thread_local", random_streams=lambda: self.rngs)
        m = monkeypatch
        m.setattr(_capture, "active", lambda: self.cap)
        m.setattr(_cuda, "driver_get_version", lambda: version)
        m.setattr(_cuda, "stream_capture_graph", self.capture_graph)
        m.setattr(_cuda, "graph_get_nodes", lambda g: [f"{g}.n{i}" for i in range(len(self.body_types))])
        m.setattr(_cuda, "graph_get_edges", self.edges)
        m.setattr(_cuda, "native", lambda h: h)
        m.setattr(_cuda, "graph_node_get_type", lambda n: getattr(
            _cuda.NodeType, "CU_GRAPH_NODE_TYPE_" + self.body_types[int(n.rsplit("n", 1)[1])]))
        m.setattr(_cond, "graph_conditional_handle_create", self.handle_create)
        m.setattr(_cond, "graph_add_conditional_node", self.add_node)
        m.setattr(_cond, "stream_set_capture_dependencies", self.set_deps)
        m.setattr(_cond, "stream_begin_capture_to_graph", self.begin)
        m.setattr(_cond, "stream_end_capture_into", self.end)
        m.setattr(_k, "function", lambda ordinal, name, source, options=None: ("F", name, options))
        m.setattr(_k, "launch", self.launch)

    def capture_graph(self, s):
        assert s == "S" and self.capturing is not None
        return self.capturing, list(self.deps.get(self.capturing, []))

    def handle_create(self, graph, ctx, default, flags):
        self.handles += 1
        h = 1000 + self.handles
        self.calls.append(("handle", graph, h))
        return h

    def edges(self, g):
        """Every node has a successor (nothing forked and left unjoined), unless ``unjoined``."""
        if self.unjoined and g == "G":
            return []
        return [(f"{g}.n{i}", "next") for i in range(len(self.body_types))]

    def add_node(self, graph, deps, h, kind, size, ctx):
        assert self.capturing == graph, "a node joins the graph the stream is capturing"
        self.nodes += 1
        node = f"c{self.nodes}"
        bodies = [f"B{self.nodes}.{i}" for i in range(size)]
        self.calls.append(("add", graph, tuple(deps), h, kind, size))
        return node, bodies

    def set_deps(self, s, nodes):
        assert s == "S" and self.capturing is not None
        self.deps[self.capturing] = list(nodes)
        self.calls.append(("deps", self.capturing, tuple(nodes)))

    def begin(self, s, graph, deps, mode):
        assert self.capturing is None
        self.capturing = graph
        self.deps[graph] = list(deps)
        self.calls.append(("begin", graph, tuple(deps)))

    def end(self, s):
        g, self.capturing = self.capturing, None
        self.calls.append(("end", g))
        return g

    def launch(self, func, grid, block, args, arg_types, s):
        assert (grid, block) == (1, 1)
        if func[1] == RK.STEP_NAME:  # a loop body's last node moves a generator record's key on
            self.calls.append(("rng_step", self.capturing, args[0]))
            self.deps.setdefault(self.capturing, []).append("rng_step")
            return
        assert func[1] == K.SET_CONDITION
        self.calls.append(("set", self.capturing, args[0], args[2]))
        self.deps.setdefault(self.capturing, []).append("set")

"""The capture path of ``cgraw.while_loop`` and ``cgraw.cond``: conditional nodes.

Layer L8 (beside ``runtime.capture``, whose running capture it extends): driver calls through
``cgraw._cuda`` (``_cuda.conditional``, ``_cuda.kernels``), decisions from ``cgraw.control.plan``,
arrays through graph trees' ``Ops`` (no framework import).

One stream. A node joins the running capture of the enclosing graph G on the capture's stream
S as in CUDA's ``graphConditionalNodes`` sample, cuda.core's ``GraphBuilder``, PyTorch and CuPy:
``cuStreamGetCaptureInfo(S)`` gives G and the stream's dependencies, ``cuGraphAddNode`` adds the
node after them and ``cuStreamUpdateCaptureDependencies(S, [node])`` puts S's next work after it.
A body is captured on S itself, which is torch's and CuPy's current stream, with cgraw's
allocation routing and library routers (cuBLAS, cuSOLVER, cuSPARSE handles) bound to it: the
capture of G pauses (``cuStreamEndCapture``: G stays the capture's), S captures the body graph
(``cuStreamBeginCaptureToGraph``) and then resumes capturing into G after the node, as Warp's
``capture_while`` pauses and resumes its stream (cuda.core, PyTorch and CuPy capture bodies on a
new stream instead, which cgraw's routers would not follow). The driver-call sequence of a loop:

1. the carried values are copied into buffers of the capture's pool (copy nodes in G), and
   ``cond_fn`` runs on them; its predicate is made a one-byte boolean on the device;
2. ``cuGraphConditionalHandleCreate(G)``; the set-condition kernel (``control/condition.cu``,
   NVRTC, an executable cubin whose ``cudaGraphSetConditional`` the driver resolves at load) is
   launched on S: the initial value;
3. ``cuGraphAddNode(G, deps, WHILE)`` gives the body graph B;
   ``cuStreamUpdateCaptureDependencies(S, [node])``; the pause refuses a side stream forked into
   the capture and not joined (``cuStreamEndCapture`` would end the whole capture), then
   ``cuStreamEndCapture(S)``;
4. ``cuStreamBeginCaptureToGraph(S, B)``; ``body_fn`` runs on the buffers; its results are
   copied into them (``plan.copy_plan``: results that overlap another buffer are cloned first);
   ``cond_fn`` runs again and the set-condition kernel sets the next value; when the body drew
   random numbers (they take offsets in the graph's draws as any captured draw does), a last
   kernel moves each generator record's key on (``rng.device.step_key``), so the next iteration
   draws fresh numbers; ``cuStreamEndCapture(S)``; B's node types are checked (``plan.body_violations``);
5. ``cuStreamBeginCaptureToGraph(S, G, [node])``: the capture goes on after the loop.

Allocations inside a body come from the capture's pool like any other in the capture, on the
same stream, so they are never handed to other work while the graph lives; the carried buffers
are held by the returned arrays. A ``cond`` is the same with an IF node of two bodies (or two IF
nodes, the second on the negated predicate), whose results are copied into buffers made by the
first branch. Whatever fails after the pause, the enclosing capture is resumed before the error
propagates (before it, the capture never stopped), so ``cgraw.capture()`` ends it and reports as for
any failed capture.
"""

from __future__ import annotations

import math

from cgraw import _cuda
from cgraw._cuda import conditional as _cond, kernels as _k
from cgraw.control import kernels as K, plan
from cgraw.rng import device as rng_device
from cgraw.errors import CaptureError, ControlFlowError
from cgraw.trees.frameworks import ops_of

_SET_TYPES = (_k.ARG_U64, _k.ARG_PTR, _k.ARG_U64)
BODY_RULES = ("a conditional body holds only kernels, copies, memsets and nested conditionals: no host "
              "synchronisation (.item(), printing a value), event, host function, stream-ordered allocation "
              "or unjoined side stream; move that work before or after the loop or branch")


def _capture_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says a stream capture refused an operation (torch's and CuPy's wording)."""
    if isinstance(exc, CaptureError):
        return True
    text = str(exc).lower()
    return "captur" in text and isinstance(exc, RuntimeError)


def while_loop(cap, cond_fn, body_fn, spec, leaves: list, paths: list):
    """The WHILE node of ``cgraw.while_loop`` in the running capture ``cap``."""
    steps = plan.node_steps("while", _cuda.driver_get_version())
    dev, stream = cap.graph.device, cap.graph.capture_stream
    mode = _cuda.CAPTURE_MODES[cap.mode]
    _require_device_arrays(leaves, paths, dev.ordinal)
    bufs = [ops_of(x).clone(x) for x in leaves]
    expected = (spec, [describe(b) for b in bufs], paths)
    values = plan.unflatten(spec, bufs)
    pred = _device_predicate(cond_fn(*values), "cond_fn", dev.ordinal)
    graph, _ = _cuda.stream_capture_graph(stream.handle)
    handle = _cond.graph_conditional_handle_create(graph, dev.context, 0, 0)
    _set_condition(dev.ordinal, handle, pred, steps[0].negate, stream.handle)
    rngs = cap.random_streams()
    before = [r.calls for r in rngs]

    def body():
        out = body_fn(*values)
        got = plan.flatten(out, "body_fn's result")
        plan.check_same("body_fn's result", expected, (got[0], [describe(x) for x in got[1]], got[2]),
                        "the carried values")
        _copy_into(bufs, got[1])
        nxt = _device_predicate(cond_fn(*values), "cond_fn", dev.ordinal)
        _set_condition(dev.ordinal, handle, nxt, False, stream.handle)
        for r, calls in zip(rngs, before):
            if r.calls != calls:  # the body draws: its last node moves the key on (rng.plan.loop_key)
                rng_device.step_key(r, stream.handle)

    _around_node(stream.handle, mode, dev.context, [(steps[0], handle)], [body], cap.graph.note_conditional)
    return plan.unflatten(spec, bufs)


def cond(cap, pred, true_fn, false_fn, operands: tuple):
    """The IF node(s) of ``cgraw.cond`` in the running capture ``cap``."""
    steps = plan.node_steps("cond", _cuda.driver_get_version())
    dev, stream = cap.graph.device, cap.graph.capture_stream
    mode = _cuda.CAPTURE_MODES[cap.mode]
    p = _device_predicate(pred, "pred", dev.ordinal)
    graph, _ = _cuda.stream_capture_graph(stream.handle)
    handles = []
    for step in steps:
        h = _cond.graph_conditional_handle_create(graph, dev.context, 0, 0)
        _set_condition(dev.ordinal, h, p, step.negate, stream.handle)
        handles.append(h)
    result: dict = {}

    def branch(fn, name: str):
        def run():
            out = fn(*operands)
            got = plan.flatten(out, f"{name}'s result")
            _require_device_arrays(got[1], got[2], dev.ordinal)
            described = (got[0], [describe(x) for x in got[1]], got[2])
            if not result:
                result["spec"], result["expected"] = got[0], described
                result["bufs"] = [ops_of(x).empty(tuple(x.shape), x) for x in got[1]]
            else:
                plan.check_same(f"{name}'s result", result["expected"], described, "true_fn's results")
            _copy_into(result["bufs"], got[1])
        return run

    _around_node(stream.handle, mode, dev.context, list(zip(steps, handles)),
                 [branch(true_fn, "true_fn"), branch(false_fn, "false_fn")], cap.graph.note_conditional)
    return plan.unflatten(result["spec"], result["bufs"])


def _around_node(s, mode, ctx, nodes: list, bodies: list, note) -> None:
    """Add the conditional ``nodes`` (``(plan.Step, handle)``, each after the previous) to the graph
    ``s`` captures, after its capture dependencies, and make the last one the stream's dependency;
    then pause the capture, capture ``bodies`` (callables, one per body graph, in order) into their
    body graphs on ``s``, and resume the enclosing capture after the last node, also on failure.
    ``note(node, kind, body graphs)`` hears of each node (``Graph.note_conditional``)."""
    graph, deps = _cuda.stream_capture_graph(s)
    after = list(deps)
    body_graphs = []
    for step, h in nodes:
        node, graphs = _cond.graph_add_conditional_node(graph, after, h, step.kind, step.size, ctx)
        note(node, step.kind, graphs)
        after = [node]
        body_graphs.extend(graphs)
    _cond.stream_set_capture_dependencies(s, after)
    _refuse_unjoined(graph, after)
    _cond.stream_end_capture_into(s)
    try:
        for run, body_graph in zip(bodies, body_graphs):
            _capture_body(s, body_graph, mode, run)
    finally:
        _cond.stream_begin_capture_to_graph(s, graph, after, mode)


def _refuse_unjoined(graph, deps: list) -> None:
    """Raise ``CaptureError`` (the capture still running) if ``graph`` has a leaf node other than
    ``deps``: work forked to a side stream and not joined, which makes the pause's
    ``cuStreamEndCapture`` fail with ``CUDA_ERROR_STREAM_CAPTURE_UNJOINED`` and end the capture."""
    if _cuda.has_leaf_outside(_cuda.graph_get_nodes(graph), _cuda.graph_get_edges(graph), deps):
        raise CaptureError("cuStreamEndCapture", 0, "CONDITIONAL_AFTER_UNJOINED_FORK",
                           "cgraw.while_loop and cgraw.cond pause the capture stream while they capture "
                           "their bodies, and a side stream forked into the capture is not joined back",
                           "join side streams before the loop or branch (the capture stream waits on "
                           "them: torch.cuda.current_stream().wait_stream(side))")


def _capture_body(s, body_graph, mode, run) -> None:
    """Capture ``run()`` into ``body_graph`` on ``s``. A failure of the capture itself (the
    body's end reports it, or the error says the stream was capturing) becomes a ``CaptureError``
    that names the body's rules; the user's own exceptions propagate unchanged."""
    _cond.stream_begin_capture_to_graph(s, body_graph, [], mode)
    try:
        run()
    except BaseException as exc:
        ended = True
        try:
            _cond.stream_end_capture_into(s)
        except Exception:  # noqa: BLE001 - the capture broke: the body's error is the one to report
            ended = False
        if isinstance(exc, Exception) and (not ended or _capture_failure(exc)):
            raise CaptureError("cuStreamEndCapture", getattr(exc, "code", 0), "CONDITIONAL_BODY_FAILED",
                               f"a cgraw.while_loop or cgraw.cond body failed to capture: {exc}", BODY_RULES) from exc
        raise
    try:
        _cond.stream_end_capture_into(s)
    except CaptureError as e:
        raise CaptureError(e.call, e.code, e.name, "a conditional body's capture failed: " + (e.description or ""),
                           e.hint) from e
    types = [_cuda.NodeType(int(_cuda.graph_node_get_type(n))).name.replace("CU_GRAPH_NODE_TYPE_", "")
             for n in _cuda.graph_get_nodes(body_graph)]
    bad = plan.body_violations(types)
    if bad:
        raise CaptureError("cuStreamEndCapture", 0, "CONDITIONAL_BODY_UNSUPPORTED",
                           "a cgraw.while_loop or cgraw.cond body holds " + "; ".join(bad))


def _copy_into(bufs: list, results: list) -> None:
    """Copy each result into its carried buffer (device copies in the graph being captured)."""
    ranges, buf_ranges, same = [], [], []
    for b, r in zip(bufs, results):
        ops = ops_of(b)
        ranges.append(_range(ops, r))
        buf_ranges.append(_range(ops, b))
        same.append(ops.ptr(r) == ops.ptr(b) and ops.key(r) == ops.key(b))
    cp = plan.copy_plan(ranges, buf_ranges, same)
    src = list(results)
    for i in cp.stage:
        src[i] = ops_of(src[i]).clone(src[i])
    for i in cp.copy:
        ops_of(bufs[i]).copy_into(bufs[i], src[i])


def _range(ops, x) -> tuple[int, int]:
    span = ops.span(x)
    if span < 0:
        return (0, -1)
    start = ops.ptr(x)
    return (start, start + span)


def describe(x) -> plan.Leaf:
    """The ``plan.Leaf`` of a value: its framework, shape and dtype."""
    ops = ops_of(x)
    if ops is not None:
        return plan.Leaf(ops.name, tuple(x.shape), str(x.dtype))
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return plan.Leaf("array", tuple(x.shape), str(x.dtype))
    return plan.Leaf("host", (), type(x).__name__)


def _require_device_arrays(leaves: list, paths: list, ordinal: int) -> None:
    for x, p in zip(leaves, paths):
        ops = ops_of(x)
        if ops is None:
            raise ControlFlowError(f"{p} is {describe(x).text()}; inside a capture the values of cgraw.while_loop "
                                   "and cgraw.cond are device arrays (torch tensors or CuPy arrays)")
        if ops.device(x) != ordinal:
            raise ControlFlowError(f"{p} is on device {ops.device(x)}, the capture on device {ordinal}")


def _device_predicate(p, who: str, ordinal: int):
    """``p`` as a one-byte boolean array on the device (a comparison node when it is not one)."""
    ops = ops_of(p)
    if ops is None:
        raise ControlFlowError(plan.HOST_PREDICATE.format(who=who, what=describe(p).text()))
    if math.prod(tuple(p.shape)) != 1:
        raise ControlFlowError(f"{who} returned an array of shape {tuple(p.shape)}; a predicate is a scalar "
                               "(reduce it first: (x > 0).all(), x.any())")
    if ops.device(p) != ordinal:
        raise ControlFlowError(f"{who}'s predicate is on device {ops.device(p)}, the capture on device {ordinal}")
    if not str(p.dtype).endswith("bool"):
        p = p != 0
    return p


def set_condition_kernel(ordinal: int):
    """The set-condition kernel on device ``ordinal`` (the current context), compiled by NVRTC with
    ``kernels.options()`` (an executable cubin; see ``cgraw.control.kernels``) and loaded once."""
    return _k.function(ordinal, K.SET_CONDITION, K.source, K.options())


def preload(values) -> None:
    """Load the set-condition kernel for the device of the first device array in ``values``, outside
    any capture (the host path calls it: a graphed function's warm-up then leaves the capture that
    follows no module to load). Never raises: the capture path reports a failure itself."""
    for x in values:
        ops = ops_of(x)
        if ops is not None and ops.device(x) >= 0:
            try:
                set_condition_kernel(ops.device(x))
            except Exception:  # noqa: BLE001 - a preload only; the capture path raises the real error
                pass
            return


def _set_condition(ordinal: int, handle, pred, negate: bool, s) -> None:
    """Launch the set-condition kernel on ``s``: ``handle`` gets ``pred`` (negated with ``negate``)."""
    func = set_condition_kernel(ordinal)
    ptr = ops_of(pred).ptr(pred)
    _k.launch(func, 1, 1, (_cond.conditional_handle_value(handle), ptr, 1 if negate else 0), _SET_TYPES, s)

"""CPU tier of ``cgraw.while_loop`` and ``cgraw.cond``: the host path's semantics and errors, the
pure plan (structures, node kinds per driver, copies, body rules), the set-condition kernel's
source and options, and the capture path against fakes of the ``_cuda`` functions it calls (the
sequence of driver calls, the carried buffers, the resumed capture on failure)."""

from __future__ import annotations

import types

import numpy as np
import pytest
from control_flow_fakes import FakeDriver

import cgraw
from cgraw import _cuda
from cgraw._cuda import conditional as _cond, kernels as _k
from cgraw.control import kernels as K, nodes, plan
from cgraw.errors import CaptureError, ControlFlowError, CudaError

torch = pytest.importorskip("torch")


# --------------------------------------------------------------------------- host path

def test_while_loop_host_numpy_and_python_scalars():
    x0 = np.random.default_rng().random(4) + 2.0
    x, n = cgraw.while_loop(lambda x, n: np.linalg.norm(x - 2.0) > 1e-6 and n < 100,
                            lambda x, n: (x * 0.5 + 1.0, n + 1), (x0, 0))
    ref, k = x0.copy(), 0
    while np.linalg.norm(ref - 2.0) > 1e-6 and k < 100:
        ref, k = ref * 0.5 + 1.0, k + 1
    assert n == k and np.array_equal(x, ref)


def test_while_loop_host_torch_device_scalar_predicate():
    g = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    x0 = torch.rand(5, generator=g) * 10
    x, n = cgraw.while_loop(lambda x, n: (x.norm() > 1e-3) & (n < 1000),
                            lambda x, n: (x * 0.5, n + 1), (x0, torch.zeros((), dtype=torch.int64)))
    ref, k = x0.clone(), 0
    while ref.norm() > 1e-3 and k < 1000:
        ref, k = ref * 0.5, k + 1
    assert int(n) == k and torch.equal(x, ref)


def test_while_loop_never_writes_the_carried_inputs():
    x0 = torch.arange(4.0)

    def body(x):
        x.add_(1)  # in place: the loop's own buffer, never the caller's
        return (x,)

    (x,) = cgraw.while_loop(lambda x: x.sum() < 20, body, (x0,))
    assert torch.equal(x0, torch.arange(4.0))
    assert torch.equal(x, torch.arange(4.0) + 4) and x.data_ptr() != x0.data_ptr()


def test_while_loop_zero_iterations_returns_copies():
    x0 = torch.ones(3)
    (x,) = cgraw.while_loop(lambda x: torch.tensor(False), lambda x: (x + 1,), (x0,))
    assert torch.equal(x, x0) and x.data_ptr() != x0.data_ptr()


def test_while_loop_nested_structures():
    out = cgraw.while_loop(lambda s: s["n"] < 3, lambda s: ({"n": s["n"] + 1, "v": (s["v"][0] * 2,)},),
                           ({"n": torch.tensor(0), "v": (torch.ones(2),)},))
    assert int(out[0]["n"]) == 3 and torch.equal(out[0]["v"][0], torch.full((2,), 8.0))


@pytest.mark.parametrize("body, words", [
    (lambda x, n: (x[:2], n + 1), ["carried[0]", "shape (2,)", "(3,)"]),
    (lambda x, n: (x.double(), n + 1), ["carried[0]", "dtype torch.float64", "torch.float32"]),
    (lambda x, n: (x,), ["structure", "a sequence of 1", "a sequence of 2"]),
    (lambda x, n: x, ["structure", "one value"]),
    (lambda x, n: (x, 1), ["carried[1]", "a host value of type int", "torch array"]),
])
def test_while_loop_body_mismatch_names_it(body, words):
    with pytest.raises(ControlFlowError) as ei:
        cgraw.while_loop(lambda x, n: n < 2, body, (torch.zeros(3), torch.tensor(0)))
    for w in words:
        assert w in str(ei.value)


@pytest.mark.parametrize("pred, words", [
    (lambda x: x, ["array of shape (3,)", "(x > 0).all()"]),
    (lambda x: x.sum(), ["dtype torch.float32", "x.norm() > tol"]),
    (lambda x: "yes", ["a str"]),
])
def test_predicate_must_be_a_boolean_scalar(pred, words):
    with pytest.raises(ControlFlowError) as ei:
        cgraw.while_loop(pred, lambda x: (x,), (torch.ones(3),))
    for w in words:
        assert w in str(ei.value)


def test_arguments_are_checked():
    with pytest.raises(ControlFlowError, match="tuple or list"):
        cgraw.while_loop(lambda x: False, lambda x: (x,), torch.ones(1))
    with pytest.raises(ControlFlowError, match="callables"):
        cgraw.while_loop(None, lambda x: (x,), (torch.ones(1),))
    with pytest.raises(ControlFlowError, match="operands"):
        cgraw.cond(True, lambda x: x, lambda x: x, torch.ones(1))


@pytest.mark.parametrize("p", [True, False])
def test_cond_host_runs_the_branch_taken_only(p):
    ran = []
    x = torch.randn(3)

    def t(x):
        ran.append("t")
        return x + 1, x.sum()

    def f(x):
        ran.append("f")
        return x - 1, x.mean()

    out = cgraw.cond(torch.tensor(p), t, f, (x,))
    ref = t(x) if p else f(x)
    assert ran == (["t", "t"] if p else ["f", "f"])
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def test_cond_host_with_python_and_numpy_predicates():
    assert cgraw.cond(np.bool_(False), lambda: 1, lambda: 2) == 2
    assert cgraw.cond(1, lambda a: a * 2, lambda a: a, (3,)) == 6


# --------------------------------------------------------------------------- the plan

def test_flatten_round_trip_and_paths():
    tree = (1, [2, {"a": 3, "b": (4,)}])
    spec, leaves, paths = plan.flatten(tree, "c")
    assert leaves == [1, 2, 3, 4]
    assert paths == ["c[0]", "c[1][0]", "c[1][1]['a']", "c[1][1]['b'][0]"]
    assert plan.unflatten(spec, leaves) == (1, (2, {"a": 3, "b": (4,)}))


def test_check_same_accepts_list_for_tuple_and_names_dtype():
    a = plan.Leaf("torch", (2,), "torch.float32")
    exp = plan.flatten((a, a), "carried")
    plan.check_same("r", exp, plan.flatten([a, a]), "the carried values")
    b = plan.Leaf("torch", (2,), "torch.int32")
    with pytest.raises(ControlFlowError, match=r"r at carried\[1\] has dtype torch.int32"):
        plan.check_same("r", exp, plan.flatten((a, b)), "the carried values")
    c = plan.Leaf("cupy", (2,), "float32")
    with pytest.raises(ControlFlowError, match="is a cupy array"):
        plan.check_same("r", exp, plan.flatten((c, a)), "the carried values")


@pytest.mark.parametrize("version, what, steps", [
    (12040, "while", [plan.Step("while")]),
    (13000, "while", [plan.Step("while")]),
    (12040, "cond", [plan.Step("if"), plan.Step("if", 1, True)]),
    (12060, "cond", [plan.Step("if"), plan.Step("if", 1, True)]),
    (12080, "cond", [plan.Step("if", 2)]),
    (13000, "cond", [plan.Step("if", 2)]),
])
def test_node_steps_per_driver(version, what, steps):
    assert plan.node_steps(what, version) == steps


@pytest.mark.parametrize("what, name", [("while", "while_loop"), ("cond", "cond")])
def test_drivers_before_12_4_are_refused_with_the_workaround(what, name):
    with pytest.raises(CaptureError) as ei:
        plan.node_steps(what, 12030)
    e = ei.value
    assert e.name == "CONDITIONAL_NODES_UNSUPPORTED" and f"cgraw.{name}" in str(e)
    assert "12.3" in str(e) and "12.4" in str(e) and "outside the capture" in e.hint


def test_copy_plan_skips_in_place_and_stages_swaps():
    bufs = [(100, 200), (200, 300), (300, 400)]
    # result 0 is buffer 0 (written in place); result 1 is buffer 2 (a swap); result 2 is fresh
    cp = plan.copy_plan([(100, 200), (300, 400), (900, 1000)], bufs, [True, False, False])
    assert cp.skip == (0,) and cp.copy == (1, 2) and cp.stage == (1,)
    # a fresh result for every buffer: no staging
    cp = plan.copy_plan([(500, 600), (600, 700), (700, 800)], bufs, [False] * 3)
    assert cp.stage == () and cp.copy == (0, 1, 2)
    # a shifted view of its own buffer overlaps it; an unknown range overlaps everything; empty never
    cp = plan.copy_plan([(110, 210), (0, -1), (300, 300)], bufs, [False] * 3)
    assert cp.stage == (0, 1)


def test_copy_plan_ignores_overlap_with_buffers_left_alone():
    # result 1 reads buffer 0, which is not written (result 0 is buffer 0 itself)
    cp = plan.copy_plan([(100, 200), (100, 200)], [(100, 200), (200, 300)], [True, False])
    assert cp.stage == () and cp.copy == (1,)


def test_body_violations_name_the_node_and_the_workaround():
    assert plan.body_violations(["KERNEL", "MEMCPY", "MEMSET", "EMPTY", "GRAPH", "CONDITIONAL"]) == []
    bad = plan.body_violations(["KERNEL", "EVENT_RECORD", "HOST", "HOST", "MEM_ALLOC", "BATCH_MEM_OP"])
    assert len(bad) == 4
    assert "event record" in bad[0] and "outside the loop" in bad[0]
    assert "host function" in bad[1] and "before the loop" in bad[1]
    assert "stream-ordered allocation" in bad[2]
    assert "batch_mem_op" in bad[3]


# --------------------------------------------------------------------------- the kernel

def test_set_condition_source_and_options():
    src = K.source(K.SET_CONDITION)
    assert 'extern "C" __global__ void cgraw_set_condition' in src and "cudaGraphSetConditional" in src
    assert "#include" not in src  # NVRTC needs no include path for it
    assert "__cudart_builtin__ void cudaGraphSetConditional(" in src  # declared, as cuda.core's tests do
    with pytest.raises(KeyError):
        K.source("other")
    # an executable cubin: -rdc=true makes a relocatable object that cuModuleLoadData cannot load
    assert K.options() == ()


def test_a_missing_nvrtc_library_is_a_cuda_error(monkeypatch):
    """cuda-bindings loads libnvrtc at the first call; its loader error becomes ``CudaError``."""
    from cuda.bindings import nvrtc

    def missing():
        raise RuntimeError('Failure finding "libnvrtc.so.13"')

    monkeypatch.setattr(nvrtc, "nvrtcVersion", missing)
    with pytest.raises(CudaError) as ei:
        _k.compile_image(K.source(K.SET_CONDITION), K.SET_CONDITION, (9, 0), K.options())
    assert ei.value.name == "NVRTC_UNAVAILABLE" and "libnvrtc" in str(ei.value)


def test_conditional_handle_value_reads_the_binding_object():
    h = _cond.drv.CUgraphConditionalHandle(0x1234)
    assert _cond.conditional_handle_value(h) == 0x1234
    assert _cond.conditional_handle_value(7) == 7


def test_add_node_compat_shapes():
    from cgraw._cuda import compat

    seen = []
    fake = types.SimpleNamespace(cuGraphAddNode=lambda *a: seen.append(a) or (0, "node"),
                                 cuStreamGetCaptureInfo=None, cuGraphGetEdges=None)
    compat.select(fake, None, "13.0.0").graph_add_node("g", ["d"], 1, "p")
    compat.select(types.SimpleNamespace(**vars(fake), cuStreamGetCaptureInfo_v3=None, cuGraphGetEdges_v2=None),
                  None, "12.9.0").graph_add_node("g", ["d"], 1, "p")
    assert seen == [("g", ["d"], None, 1, "p"), ("g", ["d"], 1, "p")]


def test_update_capture_dependencies_compat_shapes():
    """13.x: ``(stream, deps, edge_data, n, flags)``; 12.x: ``(stream, deps, n, flags)``."""
    from cgraw._cuda import compat

    seen = []
    fake = types.SimpleNamespace(cuStreamUpdateCaptureDependencies=lambda *a: seen.append(a) or (0,),
                                 cuGraphAddNode=None, cuStreamGetCaptureInfo=None, cuGraphGetEdges=None)
    compat.select(fake, None, "13.5.0").update_capture_dependencies("s", ["n"], 1, 1)
    compat.select(types.SimpleNamespace(**vars(fake), cuStreamGetCaptureInfo_v3=None, cuGraphGetEdges_v2=None),
                  None, "12.9.0").update_capture_dependencies("s", ["n"], 1, 1)
    assert seen == [("s", ["n"], None, 1, 1), ("s", ["n"], 1, 1)]


def test_update_capture_dependencies_signature_of_the_installed_bindings():
    """The installed ``cuStreamUpdateCaptureDependencies`` takes the arguments ``_compat`` passes."""
    import cuda.bindings

    from cgraw._cuda import compat

    doc = (_cond.drv.cuStreamUpdateCaptureDependencies.__doc__ or "").strip()
    if compat.bindings_major(cuda.bindings.__version__) >= 13:
        assert doc.startswith("cuStreamUpdateCaptureDependencies(hStream, dependencies") and "dependencyData" in doc

    flags = _cond.SET_CAPTURE_DEPENDENCIES
    assert int(flags) == 1 and flags.name == "CU_STREAM_SET_CAPTURE_DEPENDENCIES"


# --------------------------------------------------------------------------- the capture path, faked

def test_capture_while_driver_call_sequence(monkeypatch):
    d = FakeDriver(monkeypatch)
    x0 = torch.randn(4)
    before = x0.clone()
    x, n = cgraw.while_loop(lambda x, n: n < 3, lambda x, n: (x * 0.5, n + 1), (x0, torch.tensor(0)))
    assert d.calls == [
        ("handle", "G", 1001),
        ("set", "G", 1001, 0),           # the initial value, in the enclosing graph
        ("add", "G", ("n0", "set"), 1001, "while", 1),  # joins the running capture after its deps
        ("deps", "G", ("c1",)),          # cuStreamUpdateCaptureDependencies: next work after the node
        ("end", "G"),                    # the enclosing capture pauses
        ("begin", "B1.0", ()),           # the body, on the same stream
        ("set", "B1.0", 1001, 0),        # the next value, at the end of the body
        ("end", "B1.0"),
        ("begin", "G", ("c1",)),         # the enclosing capture resumes after the node
    ]
    assert d.capturing == "G"
    # the carried buffers are copies that the (host-run) body wrote once
    assert torch.equal(x, x0 * 0.5) and int(n) == 1 and x.data_ptr() != x0.data_ptr()
    assert torch.equal(x0, before)


@pytest.mark.parametrize("version, expect", [
    (12080, [("add", "G", ("n0", "set"), 1001, "if", 2)]),
    (12040, [("add", "G", ("n0", "set", "set"), 1001, "if", 1), ("add", "G", ("c1",), 1002, "if", 1)]),
])
def test_capture_cond_nodes_per_driver(monkeypatch, version, expect):
    d = FakeDriver(monkeypatch, version)
    x = torch.randn(3)
    out = cgraw.cond(torch.tensor(True), lambda x: (x + 1, x.sum()), lambda x: (x - 1, x.mean()), (x,))
    adds = [c for c in d.calls if c[0] == "add"]
    assert adds == expect
    sets = [c for c in d.calls if c[0] == "set"]
    if version >= 12080:
        assert sets == [("set", "G", 1001, 0)]
        bodies = ["B1.0", "B1.1"]
    else:
        assert sets == [("set", "G", 1001, 0), ("set", "G", 1002, 1)]  # the ELSE: negated predicate
        bodies = ["B1.0", "B2.0"]
    assert [c[1] for c in d.calls if c[0] == "begin"] == [*bodies, "G"]
    assert d.calls[-1] == ("begin", "G", ("c1",) if version >= 12080 else ("c2",))
    # both branches ran (captured) into the same result buffers: the false branch was last on the host
    assert torch.equal(out[0], x - 1) and torch.equal(out[1], x.mean())


def test_capture_cond_branches_must_agree(monkeypatch):
    d = FakeDriver(monkeypatch)
    with pytest.raises(ControlFlowError, match=r"false_fn's result at .*\[0\] has shape \(2,\) where true_fn's"):
        cgraw.cond(torch.tensor(True), lambda x: (x,), lambda x: (x[:2],), (torch.ones(3),))
    assert d.capturing == "G" and d.calls[-1][0] == "begin"  # resumed for capture() to end it


def test_capture_while_body_error_resumes_the_enclosing_capture(monkeypatch):
    d = FakeDriver(monkeypatch)

    def body(x):
        raise KeyError("users's own")

    with pytest.raises(KeyError):
        cgraw.while_loop(lambda x: x.sum() > 0, body, (torch.ones(2),))
    assert [c[0] for c in d.calls][-3:] == ["begin", "end", "begin"] and d.capturing == "G"


def test_capture_body_with_an_event_is_refused(monkeypatch):
    d = FakeDriver(monkeypatch, body_types=("KERNEL", "EVENT_RECORD"))
    with pytest.raises(CaptureError) as ei:
        cgraw.while_loop(lambda x: x.sum() > 100, lambda x: (x + 1,), (torch.ones(2),))
    assert ei.value.name == "CONDITIONAL_BODY_UNSUPPORTED" and "event record" in str(ei.value)
    assert d.capturing == "G"


def test_capture_a_body_that_draws_ends_with_a_step_of_the_drawing_generators_key(monkeypatch):
    d = FakeDriver(monkeypatch)
    torch_rng, cupy_rng = d.rngs

    def body(x):
        torch_rng.take(1)  # as cgraw's router hands a captured torch draw its offset
        return (x + 1,)

    cgraw.while_loop(lambda x: x.sum() < 0, body, (torch.ones(2),))
    body_calls = [c for c in d.calls if c[1] == "B1.0"]
    # after the next condition, the body's last node moves torch's key on; CuPy's drew nothing
    assert body_calls[-2:] == [("rng_step", "B1.0", torch_rng.slot), ("end", "B1.0")]
    assert [c for c in d.calls if c[0] == "rng_step"] == [("rng_step", "B1.0", torch_rng.slot)]
    assert d.capturing == "G" and torch_rng.calls == 1  # the body's offsets are the graph's


def test_capture_a_body_without_draws_has_no_key_step(monkeypatch):
    d = FakeDriver(monkeypatch)
    d.rngs[0].take(3)  # draws before the loop, in the enclosing graph

    def cond_fn(x):
        return x.sum() < 0

    cgraw.while_loop(cond_fn, lambda x: (x + 1,), (torch.ones(2),))
    assert not [c for c in d.calls if c[0] == "rng_step"]


def test_capture_nested_loops_step_the_key_in_each_body_that_draws(monkeypatch):
    d = FakeDriver(monkeypatch)
    cupy_rng = d.rngs[1]

    def inner(v):
        cupy_rng.take(1, 2)
        return (v * 2,)

    def outer(x):
        return (cgraw.while_loop(lambda v: v.sum() < 10, inner, (x,))[0] + 1,)

    cgraw.while_loop(lambda x: x.sum() < 100, outer, (torch.ones(2),))
    steps = [c for c in d.calls if c[0] == "rng_step"]
    # the inner body steps the key per inner iteration; the outer body, which holds the inner
    # loop's draws, per outer iteration (each at its body's end)
    assert [c[2] for c in steps] == [cupy_rng.slot, cupy_rng.slot]
    assert steps[0][1] != steps[1][1] and steps[1][1] == "B1.0"


def test_capture_old_driver_is_refused_before_any_node(monkeypatch):
    d = FakeDriver(monkeypatch, version=12030)
    with pytest.raises(CaptureError, match="12.4"):
        cgraw.while_loop(lambda x: x.sum() < 0, lambda x: (x,), (torch.ones(2),))
    assert d.calls == []


def test_capture_needs_device_arrays_and_device_predicates(monkeypatch):
    d = FakeDriver(monkeypatch)
    with pytest.raises(ControlFlowError, match=r"carried\[1\] is a host value of type int"):
        cgraw.while_loop(lambda x, n: n < 3, lambda x, n: (x, n + 1), (torch.ones(2), 0))
    with pytest.raises(ControlFlowError, match="cond_fn returned a host value of type bool inside a capture"):
        cgraw.while_loop(lambda x: True, lambda x: (x,), (torch.ones(2),))
    assert d.calls == []


def test_capture_cond_with_a_python_predicate_runs_the_branch_inline(monkeypatch):
    d = FakeDriver(monkeypatch)
    assert torch.equal(cgraw.cond(False, lambda x: x + 1, lambda x: x - 1, (torch.zeros(1),)), -torch.ones(1))
    assert d.calls == []


def test_capture_swapping_body_stages_the_copies(monkeypatch):
    FakeDriver(monkeypatch)
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    x, y, n = cgraw.while_loop(lambda x, y, n: n < 5, lambda x, y, n: (y, x, n + 1), (a, b, torch.tensor(0)))
    assert torch.equal(x, b) and torch.equal(y, a)  # one (host-run) iteration swapped them, none lost


def test_capture_nested_while_in_cond(monkeypatch):
    d = FakeDriver(monkeypatch)

    def t(x):
        return cgraw.while_loop(lambda v: v.sum() < 10, lambda v: (v * 2,), (x,))[0]

    cgraw.cond(torch.tensor(True), t, lambda x: x + 0, (torch.ones(2),))
    kinds = [(c[0], c[1]) for c in d.calls if c[0] in ("add", "deps", "begin", "end")]
    assert kinds == [("add", "G"), ("deps", "G"), ("end", "G"), ("begin", "B1.0"),  # the IF's then-body
                     ("add", "B1.0"), ("deps", "B1.0"), ("end", "B1.0"), ("begin", "B2.0"),  # the WHILE in it
                     ("end", "B2.0"), ("begin", "B1.0"),
                     ("end", "B1.0"), ("begin", "B1.1"), ("end", "B1.1"),  # the else-body
                     ("begin", "G")]


def test_capture_invalidated_body_names_the_body(monkeypatch):
    d = FakeDriver(monkeypatch)
    real_end = d.end

    def end(s):
        g = real_end(s)
        if g.startswith("B"):
            raise _cuda.make_error(_cuda.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "cuStreamEndCapture")
        return g

    monkeypatch.setattr(_cond, "stream_end_capture_into", end)
    with pytest.raises(CaptureError, match="a conditional body's capture failed") as ei:
        cgraw.while_loop(lambda x: x.sum() < 0, lambda x: (x,), (torch.ones(2),))
    assert "host synchronisation" in ei.value.hint and d.capturing == "G"


def test_the_guides_host_examples_run_on_the_cpu():
    """The guide's blocks that use neither torch nor CuPy (the host path on NumPy) run here; the
    others run in the GPU tier (tests/gpu/test_readme.py)."""
    import re

    import doc_blocks

    page = doc_blocks.DOCS / "guides" / "control-flow.md"
    host = [src for src in doc_blocks.FENCE.findall(page.read_text()) if not re.search(r"\b(torch|cupy)\b", src)]
    assert host
    for src in host:
        exec(compile(src, "control-flow.md", "exec"), {"__name__": "doc_example"})


def _cgraw_mode():
    """A mode of cgraw's kind (as the random-number router pushed during captures)."""
    from cgraw.interop.torch import modes as torch_modes

    class Mode(torch_modes.mode_base()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.is_higher_order(func):
                return self.run_higher_order(func, args, kwargs)
            return func(*args, **(kwargs or {}))

    return Mode()


def test_torch_cond_in_a_capture_becomes_if_nodes(monkeypatch):
    d = FakeDriver(monkeypatch)
    x = torch.randn(3)
    with _cgraw_mode():
        out = torch.cond(x.sum() > 0, lambda v: v + 1, lambda v: v - 1, (x,))
    assert [c[4:] for c in d.calls if c[0] == "add"] == [("if", 2)]
    assert d.capturing == "G" and torch.equal(out, x - 1)  # both branches captured, the false one last


def test_torch_cond_with_a_size_among_its_operands_in_a_capture_becomes_if_nodes(monkeypatch):
    """A frame torch.compile traced with dynamic shapes passes its symbolic sizes to the branches as
    Python ints among the operands; they stay host values and the branch is captured."""
    d = FakeDriver(monkeypatch)
    x = torch.randn(3)
    with _cgraw_mode():
        out = torch.ops.higher_order.cond(x.sum() > 0, lambda v, n: v + n, lambda v, n: v - n, (x, 3))
    assert [c[4:] for c in d.calls if c[0] == "add"] == [("if", 2)]
    assert torch.equal(out, x - 3)


def test_torch_while_loop_in_a_capture_becomes_a_while_node(monkeypatch):
    from torch._higher_order_ops import while_loop

    d = FakeDriver(monkeypatch)
    x = torch.randn(3)
    with _cgraw_mode():
        s = torch.tensor(2.0)  # a closure tensor: torch may pass it as an additional input
        i, v = while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v * s), (torch.tensor(0), x))
    assert [c[4:] for c in d.calls if c[0] == "add"] == [("while", 1)]
    assert int(i) == 1 and torch.equal(v, x * 2)  # the body ran once, on the host, while captured


def test_torch_cond_outside_a_capture_is_left_to_torch():
    x = torch.randn(3)
    with _cgraw_mode():
        out = torch.cond(x.sum() > 0, lambda v: v + 1, lambda v: v - 1, (x,))
    assert torch.equal(out, x + 1 if x.sum() > 0 else x - 1)


def test_set_condition_kernel_is_compiled_without_rdc_and_a_load_failure_propagates(monkeypatch):
    d = FakeDriver(monkeypatch)
    asked = []

    def function(ordinal, name, source, options):
        asked.append(options)
        return ("F", name, options)

    monkeypatch.setattr(_k, "function", function)
    cgraw.while_loop(lambda x: x.sum() < 0, lambda x: (x,), (torch.ones(2),))
    assert asked and all(o == () for o in asked)  # never -rdc=true
    assert [c[0] for c in d.calls].count("set") == 2

    def refused(ordinal, name, source, options):
        raise _cuda.make_error(_cuda.CUresult.CUDA_ERROR_INVALID_IMAGE, "cuModuleLoadData")

    monkeypatch.setattr(_k, "function", refused)
    d.calls.clear()
    with pytest.raises(CudaError, match="cuModuleLoadData"):
        cgraw.while_loop(lambda x: x.sum() < 0, lambda x: (x,), (torch.ones(2),))
    assert [c[0] for c in d.calls] == ["handle"] and d.capturing == "G"  # no node, the capture runs on


def test_capture_after_an_unjoined_fork_is_refused_before_the_pause(monkeypatch):
    d = FakeDriver(monkeypatch, unjoined=True)
    with pytest.raises(CaptureError) as ei:
        cgraw.while_loop(lambda x: x.sum() < 0, lambda x: (x,), (torch.ones(2),))
    assert ei.value.name == "CONDITIONAL_AFTER_UNJOINED_FORK" and "wait_stream" in ei.value.hint
    assert "end" not in [c[0] for c in d.calls] and d.capturing == "G"  # never paused: capture() ends it


def test_capture_refusal_inside_a_body_names_the_body_rules(monkeypatch):
    FakeDriver(monkeypatch)

    def body(x):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    with pytest.raises(CaptureError) as ei:
        cgraw.while_loop(lambda x: x.sum() < 0, body, (torch.ones(2),))
    assert ei.value.name == "CONDITIONAL_BODY_FAILED" and "no host synchronisation" in ei.value.hint
    assert "event" in ei.value.hint


def test_the_node_table_shows_conditional_nodes(monkeypatch):
    """``print(graph)`` of a graph whose second node is a conditional one (type 13), node queries faked."""
    from cgraw.runtime.graph import Graph

    T = _cuda.NodeType
    types_of = {1: T.CU_GRAPH_NODE_TYPE_KERNEL, 2: T.CU_GRAPH_NODE_TYPE_CONDITIONAL, 3: T.CU_GRAPH_NODE_TYPE_KERNEL,
                4: T.CU_GRAPH_NODE_TYPE_MEMCPY}
    monkeypatch.setattr(_cuda, "graph_get_nodes", lambda g: {"G": [1, 2], "B": [3, 4]}[g])
    monkeypatch.setattr(_cuda, "graph_get_edges", lambda g: {"G": [(1, 2)], "B": [(3, 4)]}[g])
    monkeypatch.setattr(_cuda, "graph_node_get_type", lambda n: types_of[n])
    monkeypatch.setattr(_cuda, "graph_kernel_node_get_params", lambda n: types.SimpleNamespace(
        func=0, kern=0, gridDimX=1, gridDimY=1, gridDimZ=1, blockDimX=1, blockDimY=1, blockDimZ=1, sharedMemBytes=0))
    monkeypatch.setattr(_cuda, "kernel_get_name", lambda k: "cgraw_set_condition")
    g = Graph._pending(types.SimpleNamespace(ordinal=0), None, None)
    g._graph, g._exec, g.num_nodes = "G", "E", 2
    assert int(T.CU_GRAPH_NODE_TYPE_CONDITIONAL) == 13
    g.note_conditional(2, "while", ["B"])  # as cgraw.control's capture path tells it
    assert [n.type for n in g.nodes()] == ["KERNEL", "CONDITIONAL"]
    loop = g.nodes()[1]
    assert loop.condition == "while" and [[n.type for n in b] for b in loop.bodies] == [["KERNEL", "MEMCPY"]]
    text = str(g)
    assert "NODE 1: CONDITIONAL (WHILE)" in text and "after: NODE 0" in text and "cgraw_set_condition" in text
    lines = text.splitlines()
    body = lines.index("    body 0 of NODE 1:")
    assert "body 0: 2 node(s), below" in text and lines[body + 2].startswith("    | NODE 0: KERNEL")
    assert any(line.startswith("    | NODE 1: MEMCPY") for line in lines[body:])
    assert "    | after: NODE 0" in text


def test_the_capture_path_tells_the_graph_of_each_conditional_node(monkeypatch):
    d = FakeDriver(monkeypatch)
    cgraw.while_loop(lambda x: x.sum() < 0, lambda x: (x + 1,), (torch.ones(2),))
    cgraw.cond(torch.tensor(True), lambda x: x + 1, lambda x: x - 1, (torch.ones(2),))
    assert [(kind, bodies) for _, kind, bodies in d.noted] == [("while", ["B1.0"]), ("if", ["B2.0", "B2.1"])]


def test_the_host_path_preloads_the_kernel_for_device_arrays_only(monkeypatch):
    loaded = []
    monkeypatch.setattr(nodes, "set_condition_kernel", lambda ordinal: loaded.append(ordinal))
    cgraw.while_loop(lambda x: x.sum() < 0, lambda x: (x,), (torch.ones(2),))  # a CPU tensor: device -1
    assert loaded == []

    class OnDevice:
        """A torch tensor as ``Ops`` sees one on device 3."""

    from cgraw.trees import frameworks

    class _Ops(type(frameworks.TORCH)):
        def device(self, t):
            return 3

    monkeypatch.setattr(frameworks, "_registered", [])
    frameworks.register(OnDevice, _Ops())
    try:
        nodes.preload([1, OnDevice(), OnDevice()])
    finally:
        frameworks._registered.clear()
        frameworks._by_type.clear()
    assert loaded == [3]


def test_preload_never_raises(monkeypatch):
    def fail(ordinal):
        raise _cuda.make_error(_cuda.CUresult.CUDA_ERROR_INVALID_IMAGE, "cuModuleLoadData")

    monkeypatch.setattr(nodes, "set_condition_kernel", fail)
    monkeypatch.setattr(nodes, "ops_of", lambda x: types.SimpleNamespace(device=lambda x: 0))
    nodes.preload([object()])


def test_the_host_path_in_a_warm_up_draws_as_the_device_loop_draws(monkeypatch):
    """Inside a graphed function's warm-up (draws routed to cgraw's kernels on a ``WarmStream``)
    the host loop's iterations take the offsets the first took, the generator moves for them
    once, and the key moves on after each iteration that drew, as the WHILE node does."""
    from cgraw.rng import device as rng_device, plan as rng_plan

    class Warm:  # the warm-up's side of the generator: counts what moved it
        kind = rng_plan.TORCH
        moved = 0

        def take(self, steps, n=0):
            Warm.moved += steps

    stream = rng_plan.WarmStream(0x40, -1, 0, Warm())
    steps = []
    monkeypatch.setattr(rng_device, "loop_draws", lambda: [rng_plan.LoopDraws(stream, steps.append)])
    offsets = []

    def body(x):
        offsets.append(stream.take())  # a draw inside the body
        return (x + 1,)

    def cond(x):
        offsets.append(stream.take())  # and one in the condition
        return x.sum() < 6

    x0 = torch.rand(2) * 0.5
    x, = cgraw.while_loop(cond, body, (x0,))
    torch.testing.assert_close(x, x0 + 3)  # three iterations
    # the first condition draws at 0 (the enclosing graph's); each iteration's body and condition at 1, 2
    assert offsets == [0, 1, 2, 1, 2, 1, 2]
    assert steps == [stream] * 3 and stream.calls == 3 and Warm.moved == 3 and stream.until == -1


def test_torchs_while_loop_in_a_warm_up_draws_as_the_device_loop_draws(monkeypatch):
    """torch's ``while_loop`` run by torch inside a graphed function's warm-up that draws with
    cgraw's kernels: the same offsets and key steps as ``cgraw.while_loop``'s host path (and the
    WHILE node of the recording); outside such a warm-up cgraw leaves the loop to torch."""
    from cgraw.rng import device as rng_device, plan as rng_plan

    class Warm:
        kind = rng_plan.TORCH
        moved = 0

        def take(self, steps, n=0):
            Warm.moved += steps

    stream = rng_plan.WarmStream(0x40, -1, 0, Warm())
    steps, offsets = [], []
    monkeypatch.setattr(rng_device, "loop_draws", lambda: [rng_plan.LoopDraws(stream, steps.append)])

    def body(x):
        offsets.append(stream.take())
        return (x + 1,)

    def cond(x):
        offsets.append(stream.take())
        return x.sum() < 6

    x0 = torch.rand(2) * 0.5
    monkeypatch.setattr(rng_device, "warming", lambda: True)
    with _cgraw_mode(), _cgraw_mode():  # the warm-up's observer and the random-number router: two modes see it
        x, = torch.ops.higher_order.while_loop(cond, body, (x0,), ())  # the operator the public wrapper calls
    torch.testing.assert_close(x, x0 + 3)
    assert offsets == [0, 1, 2, 1, 2, 1, 2]
    assert steps == [stream] * 3 and stream.calls == 3 and Warm.moved == 3 and stream.until == -1
    monkeypatch.setattr(rng_device, "warming", lambda: False)
    offsets.clear()
    with _cgraw_mode():
        x, = torch.ops.higher_order.while_loop(cond, body, (x0,), ())
    torch.testing.assert_close(x, x0 + 3)
    assert offsets == [3, 4, 5, 6, 7, 8, 9] and len(steps) == 3  # plain draws: torch's loop, untouched

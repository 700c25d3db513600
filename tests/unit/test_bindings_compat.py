"""CPU tier: cgraw on cuda-bindings 12.8+ and 13.x.

The installed bindings are checked against what ``_cuda`` calls (every name exists, every call's
arguments fit the signature, the edge-data shapes ``_cuda.compat`` assumes are the ones its
docstrings list). Fake driver modules shaped like 12.x and 13.x then run ``_cuda``'s wrappers
through the adapters ``_cuda.compat.select`` picks, so one installed version tests both.
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import re
from types import SimpleNamespace

import cuda.bindings
import pytest
from cuda.bindings import driver as drv
from cuda.bindings import runtime as rt

from cgraw import _cuda
from cgraw._cuda import compat as _cuda_compat, graphs as _cuda_graphs
from cgraw.errors import CaptureError

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAJOR = _cuda_compat.bindings_major(cuda.bindings.__version__)
R = _cuda.CUresult

CAPTURE_INFO_13 = ["CUresult", "captureStatus_out", "id_out", "graph_out", "dependencies_out", "edgeData_out",
                   "numDependencies_out"]
GET_EDGES_13 = ["CUresult", "from", "to", "edgeData", "numEdges"]


def _returns(fn) -> list[str]:
    """The names in the ``Returns`` section of a cuda-bindings function's docstring."""
    section = r"\n([ \t]*)Returns\n[ \t]*-+\n(.*?)(?:\n[ \t]*See Also|\n[ \t]*Notes|\Z)"
    m = re.search(section, fn.__doc__ or "", re.DOTALL)
    assert m, f"{fn.__name__} has no Returns section"
    indent = len(m.group(1))  # an entry is at the heading's indent; its description further in
    return [line.split(" : ")[0].strip() for line in m.group(2).splitlines() if line[indent:indent + 1].strip()]


def _binding_calls():
    """``(module, name, n_positional_args)`` of every ``drv.X(...)`` / ``_rt.X(...)`` call in the
    ``cgraw/_cuda/`` package."""
    for path in sorted((ROOT / "cgraw" / "_cuda").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                if isinstance(owner, ast.Name) and owner.id in ("drv", "_rt") and node.func.attr[0].islower():
                    yield owner.id, node.func.attr, len(node.args)


# --------------------------------------------------------------------------- installed bindings

def test_installed_version_is_supported():
    assert MAJOR in (12, 13), cuda.bindings.__version__
    major, minor = (int(x) for x in cuda.bindings.__version__.split(".")[:2])
    assert (major, minor) >= (12, 8)
    assert _cuda._compat.major == MAJOR and _cuda._compat.version == cuda.bindings.__version__
    assert _cuda_graphs._compat is _cuda._compat  # selected once, for the whole package
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"cuda-bindings>=12.8,<14"' in pyproject


def test_compat_module_imports_no_bindings():
    tree = ast.parse((ROOT / "cgraw" / "_cuda" / "compat.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"__future__", "types"}, imported


@pytest.mark.parametrize("owner,name,nargs", sorted(set(_binding_calls())))
def test_every_call_fits_the_installed_binding(owner, name, nargs):
    fn = getattr(drv if owner == "drv" else rt, name, None)
    assert fn is not None, f"cuda-bindings {cuda.bindings.__version__} has no {name}"
    if not isinstance(fn, type):  # a handle type (cudaGraphExec_t) takes its value; calls are checked
        inspect.signature(fn).bind(*range(nargs))  # TypeError when the arity differs


def test_destroy_calls_exist():
    for call in _cuda._DESTROY.values():
        assert callable(getattr(drv, call)), call


def test_capture_info_and_edges_have_the_shapes_compat_assumes():
    if MAJOR >= 13:
        assert _returns(drv.cuStreamGetCaptureInfo) == CAPTURE_INFO_13
        assert _returns(drv.cuGraphGetEdges) == GET_EDGES_13
        assert _cuda._compat.capture_info is drv.cuStreamGetCaptureInfo
        assert _cuda._compat.graph_get_edges is drv.cuGraphGetEdges
    else:
        # 12.x: the versioned calls have 13.x's shape; the plain ones lack edge data at index 5 / 3
        assert _returns(drv.cuStreamGetCaptureInfo_v3) == CAPTURE_INFO_13
        assert _returns(drv.cuStreamGetCaptureInfo) == [n for n in CAPTURE_INFO_13 if n != "edgeData_out"]
        assert _returns(drv.cuGraphGetEdges_v2) == GET_EDGES_13
        assert _returns(drv.cuGraphGetEdges) == [n for n in GET_EDGES_13 if n != "edgeData"]
    inspect.signature(drv.cuStreamGetCaptureInfo).bind(0)
    inspect.signature(drv.cuGraphGetEdges).bind(0, 0)


def test_hot_paths_are_the_bindings_themselves():
    assert _cuda.graph_launch_raw is drv.cuGraphLaunch
    assert _cuda.memcpy_node_set_1d_raw is rt.cudaGraphExecMemcpyNodeSetParams1D
    assert "_compat" not in inspect.getsource(_cuda.MemcpyNodeSetter.__call__)
    inspect.signature(_cuda.graph_launch_raw).bind(0, 0)  # (exec, stream), as the replay calls it
    inspect.signature(_cuda.memcpy_node_set_1d_raw).bind(*range(6))


@pytest.mark.parametrize("kind", ["CUstream", "CUgraph", "CUgraphExec", "CUgraphNode", "CUevent", "CUcontext",
                                  "CUfunction", "CUkernel"])
def test_native_handle_with_and_without_utils(kind):
    h = getattr(drv, kind)(0x1234)
    assert _cuda.native(h) == 0x1234
    no_utils = _cuda_compat.select(drv, None, cuda.bindings.__version__)  # 12.8 has no cuda.bindings.utils
    assert no_utils.native_handle is int and no_utils.native_handle(h) == 0x1234


def test_error_string_is_asked_with_the_enum(monkeypatch):
    """12.8's cuGetErrorString rejects a plain int (AttributeError), which lost every description."""
    seen = []

    def fake(error):
        seen.append(error)
        _ = error.value  # what 12.8 does with its argument
        return (R.CUDA_SUCCESS, b"operation not permitted when stream is capturing")

    monkeypatch.setattr(_cuda.drv, "cuGetErrorString", fake)
    e = _cuda.make_error(int(R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED), "cuMemAlloc")
    assert isinstance(seen[0], R) and e.description.startswith("operation not permitted")
    assert _cuda.make_error(123456, "cuFoo").description == ""  # not a CUresult: no call, no crash


# --------------------------------------------------------------------------- fake 12.x and 13.x modules

class Counted:
    def __init__(self, result=None, exc=None):
        self.result, self.exc, self.calls = result, exc, 0
        self.__name__ = "fake"

    def __call__(self, *args):
        self.calls += 1
        if self.exc is not None:
            raise self.exc
        return self.result


def fake12(v3_exc=None, plain_exc=None, versioned=True):
    m = SimpleNamespace(
        cuStreamGetCaptureInfo=Counted((0, 1, 7, "graph", ["n1", "n2"], 2), plain_exc),
        cuGraphGetEdges=Counted((0, ["a", "c"], ["b", "d"], 2), plain_exc),
    )
    if versioned:
        m.cuStreamGetCaptureInfo_v3 = Counted((0, 1, 7, "graph", ["n1", "n2"], ["e1", "e2"], 2), v3_exc)
        m.cuGraphGetEdges_v2 = Counted((0, ["a", "c"], ["b", "d"], ["e1", "e2"], 2), v3_exc)
    return m


def fake13():
    return SimpleNamespace(
        cuStreamGetCaptureInfo=Counted((0, 1, 7, "graph", ["n1", "n2"], ["e1", "e2"], 2)),
        cuGraphGetEdges=Counted((0, ["a", "c"], ["b", "d"], ["e1", "e2"], 2)),
    )


def _through_cuda(monkeypatch, compat):
    """Run _cuda's wrappers with ``compat`` as the adapters (the capture and edge queries live in
    ``_cuda.graphs``, which holds its own reference to the package's adapters)."""
    monkeypatch.setattr(_cuda_graphs, "_compat", compat)
    assert _cuda.stream_capture_info(5) == (1, 7)
    assert _cuda.stream_capture_graph(5) == ("graph", ["n1", "n2"])
    assert _cuda.graph_get_edges("graph") == [("a", "b"), ("c", "d")]


def test_bindings_major():
    assert _cuda_compat.bindings_major("12.9.4") == 12
    assert _cuda_compat.bindings_major("13.0.0rc1") == 13
    assert _cuda_compat.bindings_major("unknown") == 0


def test_13_uses_the_plain_calls_unwrapped(monkeypatch):
    m = fake13()
    utils = SimpleNamespace(get_cuda_native_handle=lambda h: 99)
    c = _cuda_compat.select(m, utils, "13.0.1")
    assert c.capture_info is m.cuStreamGetCaptureInfo and c.graph_get_edges is m.cuGraphGetEdges
    assert c.native_handle(object()) == 99
    _through_cuda(monkeypatch, c)


def test_12_uses_the_edge_aware_calls(monkeypatch):
    m = fake12()
    c = _cuda_compat.select(m, None, "12.9.4")
    assert c.capture_info(5) == m.cuStreamGetCaptureInfo_v3.result
    assert c.graph_get_edges("g", 2) == m.cuGraphGetEdges_v2.result
    assert c.native_handle is int
    _through_cuda(monkeypatch, c)
    assert m.cuStreamGetCaptureInfo.calls == 0 and m.cuGraphGetEdges.calls == 0


def test_12_on_a_driver_without_edge_data_falls_back_once(monkeypatch):
    """A CUDA 12.0-12.2 driver lacks the _v3/_v2 entry points (FunctionNotFoundError)."""
    m = fake12(v3_exc=RuntimeError("function cuStreamGetCaptureInfo_v3 is not found"))
    c = _cuda_compat.select(m, None, "12.8.0")
    assert c.capture_info(5) == (0, 1, 7, "graph", ["n1", "n2"], None, 2)  # widened to 13.x's shape
    assert c.graph_get_edges("g", 0) == (0, ["a", "c"], ["b", "d"], None, 2)
    _through_cuda(monkeypatch, c)
    assert m.cuStreamGetCaptureInfo_v3.calls == 1 and m.cuGraphGetEdges_v2.calls == 1  # tried once only
    assert m.cuStreamGetCaptureInfo.calls == 3


def test_12_without_a_driver_decides_nothing():
    m = fake12(v3_exc=RuntimeError("no libcuda"), plain_exc=RuntimeError("no libcuda"))
    c = _cuda_compat.select(m, None, "12.9.0")
    with pytest.raises(RuntimeError):
        c.capture_info(5)
    m.cuStreamGetCaptureInfo_v3.exc = m.cuStreamGetCaptureInfo.exc = None  # the driver appears
    assert c.capture_info(5) == m.cuStreamGetCaptureInfo_v3.result


def test_12_bindings_before_12_3_are_widened(monkeypatch):
    c = _cuda_compat.select(fake12(versioned=False), None, "12.2.0")
    assert c.capture_info(5) == (0, 1, 7, "graph", ["n1", "n2"], None, 2)
    _through_cuda(monkeypatch, c)


@pytest.mark.parametrize("version", ["12.9.4", "13.0.1"])
def test_failures_keep_the_call_name(monkeypatch, version):
    err = R.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
    m = fake12() if version.startswith("12") else fake13()
    for fn in vars(m).values():
        fn.result = (err,) + (None,) * (len(fn.result) - 1)
    monkeypatch.setattr(_cuda_graphs, "_compat", _cuda_compat.select(m, None, version))
    with pytest.raises(CaptureError, match="^cuStreamGetCaptureInfo: CUDA_ERROR_STREAM_CAPTURE_IMPLICIT"):
        _cuda.stream_capture_info(5)
    with pytest.raises(CaptureError, match="^cuGraphGetEdges:"):
        _cuda.graph_get_edges("g")

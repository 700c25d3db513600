"""CPU tier of ``cgraw.interop.cupy.sparse`` (CuPy's cuSPARSE calls inside captures), without CuPy or
a GPU: fakes shaped like CuPy 14's ``cupy_backends.cuda.libs.cusparse`` (Python functions with its
wrappers' signatures, its refusal on a capturing stream), ``cupy`` (devices, streams, handles) and a
ctypes library that records its calls. The table is also checked, argument by argument, against the
signatures embedded in CuPy 14.2's wheel when it is unpacked here. What these cannot show (cuSPARSE in
a real capture, replayed) is tests/gpu/test_cupy_sparse.py."""

from __future__ import annotations

import ctypes
import glob
import re
import sys
import threading
import types

import pytest
from cupy_lib_fakes import FakeDevice, FakeDll, fresh_routing
from cupy_lib_fakes import call_from_cupy as _call_from_cupy

from cgraw.errors import CaptureError
from cgraw.interop.cupy import sparse as S

CAPTURE, EAGER = 0x5000, 0x6000

# argument counts of CuPy 14.2's wrappers (cupy_backends/cuda/libs/cusparse.pyx), the handle included
CUPY14_ARITY = {"spMV_bufferSize": 9, "spMV": 10, "spMM_bufferSize": 10, "spMM": 11, "sparseToDense_bufferSize": 4,
                "sparseToDense": 5, "xcsr2coo": 6}
# refused: csr2cscEx2 broke the context on the H200; the rest no GPU test reaches
REFUSED_UNSAFE_OR_UNVERIFIED = ("csr2cscEx2_bufferSize", "csr2cscEx2", "xcoo2csr", "xcoosort_bufferSizeExt", "xcsrsort_bufferSizeExt",
               "xcscsort_bufferSizeExt", "xcoosortByRow", "xcoosortByColumn", "xcsrsort", "xcscsort",
               "createIdentityPermutation", "gather")
# the parameter types of CuPy's wrappers that cgraw passes as C ints; size_t and intptr_t are pointers
INT_TYPES = {"int", "Operation", "DataType", "SpMVAlg", "SpMMAlg", "IndexBase", "IndexType", "Action", "Csr2CscAlg",
             "Order"}


class FakeCuSparseError(RuntimeError):
    pass


def _make_backend(state):
    m = types.ModuleType(S.BACKEND)

    def refuse_or_run(name):
        if state["current"] in state["capturing"]:
            raise NotImplementedError("calling cuSPARSE API during stream capture is currently unsupported")
        state["eager"].append(name)

    def spMV_bufferSize(handle, opA, alpha, matA, vecX, beta, vecY, computeType, alg):  # no setStream in CuPy
        state["eager"].append("spMV_bufferSize")
        return 12

    def spMV(handle, opA, alpha, matA, vecX, beta, vecY, computeType, alg, externalBuffer):
        refuse_or_run("spMV")

    def xcsr2coo(handle, csrRowPtr, nnz, m, cooRowInd, idxBase):
        refuse_or_run("xcsr2coo")

    def spMM(handle, opA, opB, alpha):  # another shape than cgraw's table: must stay CuPy's
        refuse_or_run("spMM")

    def scsrgeam2_bufferSizeExt(handle, m, n, alpha, descrA, nnzA, csrValA, csrRowPtrA, csrColIndA, beta, descrB,
                                nnzB, csrValB, csrRowPtrB, csrColIndB, descrC, csrValC, csrRowPtrC, csrColIndC):
        refuse_or_run("scsrgeam2_bufferSizeExt")
        return 64

    def setPointerMode(handle, mode):
        state["modes"].append((handle, mode))

    def check_status(status):
        raise FakeCuSparseError(f"CUSPARSE_STATUS {status}")

    for fn in (spMV_bufferSize, spMV, xcsr2coo, spMM, scsrgeam2_bufferSizeExt, setPointerMode, check_status):
        setattr(m, fn.__name__, fn)
    return m


@pytest.fixture
def env(monkeypatch):
    state = {"current": CAPTURE, "capturing": {CAPTURE}, "eager": [], "handles": {}, "status": 1, "modes": []}
    backend = _make_backend(state)
    cp = types.ModuleType("cupy")

    def get_cusparse_handle():
        return state["handles"].setdefault(threading.get_ident(), 0x300 + len(state["handles"]))


    cp.cuda = types.SimpleNamespace(Device=FakeDevice,
                                    device=types.SimpleNamespace(get_cusparse_handle=get_cusparse_handle),
                                    get_current_stream=lambda: types.SimpleNamespace(ptr=state["current"]))
    for name, mod in (("cupy", cp), (S.BACKEND, backend)):
        monkeypatch.setitem(sys.modules, name, mod)
    fresh_routing(monkeypatch, S)
    dll = FakeDll("cusparse", lambda name: name == "cusparseCreate", 0xC000, 4096, (ctypes.c_size_t,))
    state.update(backend=backend, dll=dll, lib=S.Library(dll, "fake/libcusparse.so.12"))
    yield state
    assert not S._routers and not S._patches, "a test left CuPy's cuSPARSE functions replaced"


def _router(state):
    return S.Router(state["lib"], 0, CAPTURE, status=lambda: state["status"])



SPMV_ARGS = (0, 0x10, 0x20, 0x30, 0x40, 0x50, 0, 0)  # opA, alpha, matA, vecX, beta, vecY, computeType, alg
GEAM_ARGS = (32, 48, 0x10, 0x11, 225, 0x12, 0x13, 0x14, 0x15, 0x16, 225, 0x17, 0x18, 0x19, 0x1A, 0, 0x1B, 0)


# ---------------------------------------------------------------- the table


def test_table_matches_cupy14_wrapper_signatures():
    for name, arity in CUPY14_ARITY.items():
        assert S.cupy_arity(S.SPECS[name]) == arity, name
    assert all(set(kinds) <= set(S._CTYPES) for kinds in S.SPECS.values())
    assert not set(S.SPECS) & set(S.REFUSED)
    for name, kinds in S.SPECS.items():  # a query returns its one size; nothing else writes an output
        assert kinds.count("z") == (1 if "bufferSize" in name else 0) and kinds.find("z") in (-1, len(kinds) - 1)
    for dtype in "sdcz":
        assert S.REFUSED[f"{dtype}csrgeam2_bufferSizeExt"] is S._GEAM and S.REFUSED[f"{dtype}csrgeam2"] is S._GEAM
        assert S.REFUSED[f"{dtype}nnz_compress"] is S._NNZ
    assert S.REFUSED["xcsrgeam2Nnz"] is S._GEAM and "csrgeam2" in S._GEAM
    assert S.REFUSED["spGEMM_compute"] is S._SPGEMM and S.REFUSED["denseToSparse_analysis"] is S._DENSE2SPARSE
    assert set(S.SPECS) == set(CUPY14_ARITY)  # routed: only what a GPU test verified
    assert all(S.REFUSED[n] is (S._CSR2CSC if n.startswith("csr2csc") else S._UNVERIFIED) for n in REFUSED_UNSAFE_OR_UNVERIFIED)
    assert "outside the capture" in S.HINTS[S._CSR2CSC]
    assert S.symbol("spMV_bufferSize") == "cusparseSpMV_bufferSize"
    assert S.symbol("xcsr2coo") == "cusparseXcsr2coo" and S.symbol("gather") == "cusparseGather"
    assert S.symbol("scsrgeam2_bufferSizeExt") == "cusparseScsrgeam2_bufferSizeExt"


def _wheel_signatures() -> dict[str, list[str]]:
    """name -> parameter types after the handle, from the signatures Cython embedded in CuPy 14.2's
    cusparse module."""
    paths = (glob.glob("/tmp/cupy*/cupy_backends/cuda/libs/cusparse.cpython-*.so")
             + glob.glob("/tmp/cpx/cupy_backends/cuda/libs/cusparse.cpython-*.so"))
    if not paths:
        pytest.skip("CuPy 14.2's wheel is not unpacked here (/tmp/cupy*/cupy_backends)")
    data = open(paths[0], "rb").read()
    out = {}
    for m in re.finditer(rb"\n?([a-zA-Z_0-9]+)\((intptr_t handle[^)]*)\)", data):
        params = [p.strip().split()[0] for p in m.group(2).decode().split(",")]
        out.setdefault(m.group(1).decode(), params[1:])
    return out


def test_table_matches_the_unpacked_wheel_argument_by_argument():
    sigs = _wheel_signatures()
    missing = [n for n in (*S.SPECS, *S.REFUSED) if n not in sigs]
    assert not missing, missing
    wrong = {}
    for name, kinds in S.SPECS.items():
        want = "".join("i" if t in INT_TYPES else "p" if t in ("size_t", "intptr_t") else "?" for t in sigs[name])
        got = "".join(k for k in kinds if k not in S._OUTS)
        if got != want:
            wrong[name] = (sigs[name], kinds)
    assert not wrong, wrong
    assert "setPointerMode" in sigs and "getPointerMode" not in sigs  # why cgraw sets HOST and mirrors the setter


def test_library_candidates_put_the_loaded_cupy_copy_first():
    maps = ("7f00-7f01 r-xp 0 08:01 1 /opt/torch/lib/libcusparse.so.12\n"
            "7f02-7f03 r-xp 0 08:01 2 /site/cupy/.data/libcusparse.so.12.7\n"
            "7f04-7f05 r-xp 0 08:01 3 /site/cupy/.data/libcusparseLt.so.0\n")
    paths = S.candidate_paths(maps)
    assert paths[:2] == ["/site/cupy/.data/libcusparse.so.12.7", "/opt/torch/lib/libcusparse.so.12"]
    assert paths[2:] == list(S.SONAMES)


def test_no_router_when_disabled_or_cupy_is_not_as_expected(env, monkeypatch):
    pool = types.SimpleNamespace(device=types.SimpleNamespace(ordinal=0))
    stream = types.SimpleNamespace(ptr=CAPTURE, capture_status=1)
    S._library_cache.append(env["lib"])
    assert isinstance(S.router(pool, stream), S.Router)
    monkeypatch.setenv("CGRAW_CUPY_CUSPARSE", "0")
    assert S.router(pool, stream) is None
    monkeypatch.delenv("CGRAW_CUPY_CUSPARSE")
    monkeypatch.delattr(sys.modules["cupy"].cuda.device, "get_cusparse_handle")
    assert S.router(pool, stream) is None


def test_the_capture_makes_a_sparse_router_next_to_the_solvers(env, monkeypatch):
    from cgraw import capture
    from cgraw.interop.cupy import pools as icupy, blas as cupy_blas, solver as cupy_solver

    made = []
    monkeypatch.setattr(icupy, "cupy_module", lambda: sys.modules["cupy"])
    monkeypatch.setattr(icupy, "CupyRouting", lambda *a, **k: "cupy")
    monkeypatch.setattr(cupy_blas, "router", lambda *a, **k: None)
    monkeypatch.setattr(cupy_solver, "router", lambda *a, **k: made.append("solver") or "solver")
    monkeypatch.setattr(S, "router", lambda pool, stream: made.append("sparse") or "sparse")
    c = capture(pool=None, frameworks=("cupy",))
    assert c._make_adapters(None, None) == ["cupy", "solver", "sparse"] and made == ["solver", "sparse"]


# ---------------------------------------------------------------- routing


def test_calls_of_the_capture_go_to_cgraws_handle_and_the_handle_is_reused(env):
    backend, dll = env["backend"], env["dll"]
    originals = {n: getattr(backend, n) for n in ("spMV", "spMV_bufferSize", "xcsr2coo", "spMM",
                                                  "scsrgeam2_bufferSizeExt", "setPointerMode")}
    r = _router(env)
    r.enter()
    mine, h = r.handle, r.cupy_handle
    assert mine == 0xC000 and dll.named("cusparseSetStream")[-1] == (mine, CAPTURE)
    assert dll.named("cusparseSetPointerMode")[-1] == (mine, S.POINTER_MODE_HOST)
    assert backend.spMV is not originals["spMV"] and backend.spMV.__name__ == "spMV"
    assert backend.spMM is originals["spMM"]  # another shape: CuPy's, with its refusal

    assert backend.spMV_bufferSize(h, *SPMV_ARGS) == 4096  # the size cuSPARSE wrote, as CuPy returns it
    (args,) = dll.named("cusparseSpMV_bufferSize")
    assert args[:9] == (mine, *SPMV_ARGS) and isinstance(args[9]._obj, ctypes.c_size_t)
    assert backend.spMV(h, *SPMV_ARGS, 0x60) is None
    assert dll.named("cusparseSpMV") == [(mine, *SPMV_ARGS, 0x60)]
    backend.xcsr2coo(h, 0x70, 225, 32, 0x80, 0)
    assert dll.named("cusparseXcsr2coo") == [(mine, 0x70, 225, 32, 0x80, 0)]
    assert r.calls == 3 and not env["eager"]

    with pytest.raises(NotImplementedError):
        backend.spMV(0x999, *SPMV_ARGS, 0x60)  # the user's own handle: CuPy's path
    env["current"] = EAGER
    backend.spMV(h, *SPMV_ARGS, 0x60)  # another stream: CuPy, eagerly
    backend.scsrgeam2_bufferSizeExt(h, *GEAM_ARGS)  # refused only on the capture stream
    assert env["eager"] == ["spMV", "scsrgeam2_bufferSizeExt"]
    env["current"] = CAPTURE

    r.exit()
    assert all(getattr(backend, n) is f for n, f in originals.items())
    assert dll.named("cusparseSetStream")[-1] == (mine, 0) and S._idle == {0: [mine]}
    r2 = _router(env)
    r2.enter()
    assert r2.handle == mine and len(dll.named("cusparseCreate")) == 1  # reused, not created again
    r2.exit()


def test_sparse_plus_sparse_is_refused_naming_csrgeam2_before_cusparse_is_called(env):
    backend, dll = env["backend"], env["dll"]
    r = _router(env)
    r.enter()
    h = r.cupy_handle
    backend.setPointerMode(h, 0)  # csrgeam2 sets HOST on CuPy's handle first
    with pytest.raises(CaptureError, match="csrgeam2") as ei:
        _call_from_cupy("cupyx.scipy.sparse._compressed", "__add__",
                        lambda: backend.scsrgeam2_bufferSizeExt(h, *GEAM_ARGS))
    e = ei.value
    assert e.name == "CUSPARSE_NOT_COVERED" and "cupyx.scipy.sparse._compressed.__add__" in e.description
    assert "cusparseScsrgeam2_bufferSizeExt" in e.description and "host" in e.description
    assert ".data" in e.hint
    assert not [n for n, _ in dll.calls if "geam" in n.lower()] and not env["eager"]
    r.exit()


def test_bad_arguments_invalidation_and_failures(env):
    backend, dll = env["backend"], env["dll"]
    r = _router(env)
    r.enter()
    h = r.cupy_handle
    with pytest.raises(CaptureError, match="does not fit"):
        backend.xcsr2coo(h, 0x70, 1 << 33, 32, 0x80, 0)
    env["status"] = S.CAPTURE_INVALIDATED  # cuSPARSE synchronised inside
    with pytest.raises(CaptureError, match="invalidated") as ei:
        _call_from_cupy("cupyx.scipy.sparse._base", "dot", lambda: backend.spMV(h, *SPMV_ARGS, 0x60))
    assert "cupyx.scipy.sparse._base.dot" in ei.value.description and "cusparseSpMV" in ei.value.description
    env["status"] = 1
    dll.status["cusparseSpMV"] = 3
    with pytest.raises(FakeCuSparseError, match="3"):  # CuPy's own error, as eager
        backend.spMV(h, *SPMV_ARGS, 0x60)
    del backend.check_status  # without CuPy's checker: cgraw's own error names the routine and status
    with pytest.raises(CaptureError, match="INVALID_VALUE") as ei:
        backend.spMV(h, *SPMV_ARGS, 0x60)
    assert ei.value.call == "cusparseSpMV"
    r.exit(failed=True)


def test_the_pointer_mode_cupy_sets_is_mirrored_only_from_cupys_handle(env):
    backend, dll = env["backend"], env["dll"]
    r = _router(env)
    r.enter()
    mine, h = r.handle, r.cupy_handle
    before = len(dll.named("cusparseSetPointerMode"))
    backend.setPointerMode(h, 1)
    assert env["modes"] == [(h, 1)] and dll.named("cusparseSetPointerMode")[-1] == (mine, 1)
    backend.setPointerMode(0x999, 0)  # another handle: CuPy's alone
    assert env["modes"][-1] == (0x999, 0) and len(dll.named("cusparseSetPointerMode")) == before + 1
    r.exit()
    r2 = _router(env)
    r2.enter()  # the pooled handle goes back to HOST
    assert r2.handle == mine and dll.named("cusparseSetPointerMode")[-1] == (mine, S.POINTER_MODE_HOST)
    r2.exit()


def test_the_capture_turns_a_refusal_into_its_own_words(env):
    from cgraw import capture

    msg = capture(pool=None)._classify(S._not_covered("xcsrgeam2Nnz", S._GEAM, S.HINTS[S._GEAM]), 0, 0)
    assert "cuSPARSE xcsrgeam2Nnz" in msg and "cusparseXcsrgeam2Nnz" in msg and ".data" in msg


def test_a_failed_enter_leaves_nothing_replaced_and_exit_after_a_failure_restores(env):
    backend, dll = env["backend"], env["dll"]
    original = backend.spMV
    dll.status["cusparseSetStream"] = 3
    r = _router(env)
    with pytest.raises(CaptureError, match="cusparseSetStream"):
        r.enter()
    assert not S._patches and not S._routers and r.handle is None
    dll.status.clear()
    r = _router(env)
    r.enter()
    dll.status["cusparseSpMV"] = 6
    with pytest.raises(FakeCuSparseError):
        backend.spMV(r.cupy_handle, *SPMV_ARGS, 0x60)
    mine = r.handle
    r.exit(failed=True)
    assert backend.spMV is original and dll.named("cusparseSetStream")[-1] == (mine, 0)
    assert mine in S._idle[0]


def test_two_captures_on_two_threads_use_two_handles(env):
    backend, dll = env["backend"], env["dll"]
    ready, go, done = threading.Barrier(2), threading.Event(), []

    def capture_on_thread():
        r = _router(env)
        r.enter()
        ready.wait()
        go.wait()
        backend.spMV(r.cupy_handle, *SPMV_ARGS, 0x60)
        done.append(r.handle)
        r.exit()

    t = threading.Thread(target=capture_on_thread)
    t.start()
    r = _router(env)
    r.enter()
    ready.wait()
    backend.spMV(r.cupy_handle, *SPMV_ARGS, 0x60)
    with pytest.raises(NotImplementedError):  # the other thread's CuPy handle is not this router's
        backend.spMV(env["handles"][t.ident], *SPMV_ARGS, 0x60)
    mine = r.handle
    r.exit()
    assert S._patches  # the other capture still routes
    go.set()
    t.join()
    assert {a[0] for a in dll.named("cusparseSpMV")} == {mine, done[0]} and mine != done[0]
    assert not S._patches

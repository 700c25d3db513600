"""CPU tier of ``cgraw.interop.cupy_solver`` (CuPy's cuSOLVER calls inside captures), without CuPy or
a GPU: fakes shaped like CuPy 14's ``cupy_backends.cuda.libs.cusolver`` (Python functions with its
wrappers' signatures, its refusal on a capturing stream), ``cupy`` (devices, streams, handles),
``cupy.linalg._util``'s info check, and a ctypes library that records its calls. The table is also
checked against the signatures embedded in CuPy 14.2's wheel when it is unpacked here. What these
cannot show (cuSOLVER in a real capture, replayed) is tests/gpu/test_cupy_libs.py: not yet run on the H200."""

from __future__ import annotations

import ctypes
import glob
import re
import sys
import threading
import types

import pytest

from cgraw.errors import CaptureError
from cgraw.interop import cupy_route as R
from cgraw.interop import cupy_solver as S

CAPTURE, EAGER = 0x5000, 0x6000

# argument counts of CuPy 14.2's wrappers (cupy_backends/cuda/libs/cusolver.pyx), the handle included
CUPY14_ARITY = {"sgetrf_bufferSize": 5, "sgetrf": 8, "zgetrs": 10, "spotrf_bufferSize": 5, "dpotrf": 8,
                "cpotrs": 9, "spotrfBatched": 7, "zpotrsBatched": 10, "sgeqrf_bufferSize": 5, "dgeqrf": 9,
                "sorgqr_bufferSize": 7, "cungqr": 10, "dormqr_bufferSize": 11, "zunmqr": 14,
                "sgesvdjBatched_bufferSize": 13, "dgesvdjBatched": 16, "ssyevjBatched_bufferSize": 9,
                "zheevjBatched": 12}


class FakeFn:
    def __init__(self, dll, name):
        self.dll, self.name, self.argtypes, self.restype = dll, name, None, None

    def __call__(self, *args):
        self.dll.calls.append((self.name, args))
        if self.name == "cusolverDnCreate":
            args[0]._obj.value = self.dll.next_handle
            self.dll.next_handle += 0x100
        for a in args:  # outputs: the routine writes them
            obj = getattr(a, "_obj", None)
            if isinstance(obj, (ctypes.c_int, ctypes.c_size_t)):
                obj.value = self.dll.out_value
        return self.dll.status.get(self.name, 0)


class FakeDll:
    def __init__(self):
        self.calls, self.status, self.next_handle, self.out_value = [], {}, 0xB000, 77

    def __getattr__(self, name):
        if not name.startswith("cusolverDn"):
            raise AttributeError(name)
        fn = FakeFn(self, name)
        setattr(self, name, fn)
        return fn

    def named(self, name):
        return [args for n, args in self.calls if n == name]


class FakeCUSOLVERError(RuntimeError):
    pass


def _make_backend(state):
    m = types.ModuleType(S.BACKEND)

    def refuse_or_run(name, args):
        if state["current"] in state["capturing"]:
            raise NotImplementedError("calling cuSOLVER API during stream capture is currently unsupported")
        state["eager"].append(name)

    def sgetrf_bufferSize(handle, m, n, A, lda):
        refuse_or_run("sgetrf_bufferSize", locals())
        return 5

    def sgetrf(handle, m, n, A, lda, work, devIpiv, devInfo):
        refuse_or_run("sgetrf", locals())

    def sgesvdjBatched_bufferSize(handle, jobz, m, n, A, lda, S, U, ldu, V, ldv, params, batchSize):
        refuse_or_run("sgesvdjBatched_bufferSize", locals())

    def xsyevd_bufferSize(handle, params, jobz, uplo, n, dataTypeA, A, lda, dataTypeW, W, computeType):
        refuse_or_run("xsyevd_bufferSize", locals())

    def xsyevd(handle, params, jobz, uplo, n, dataTypeA, A, lda, dataTypeW, W, computeType, bufferOnDevice,
               workspaceInBytesOnDevice, bufferOnHost, workspaceInBytesOnHost, info):
        refuse_or_run("xsyevd", locals())

    def spotrf(handle, uplo, n):  # another shape than cgraw's table: must stay CuPy's
        refuse_or_run("spotrf", locals())

    def ssyevj(handle, jobz, uplo, n, A, lda, W, work, lwork, info, params):  # refused by name
        refuse_or_run("ssyevj", locals())

    def check_status(status):
        raise FakeCUSOLVERError(f"CUSOLVER_STATUS {status}")

    for fn in (sgetrf_bufferSize, sgetrf, sgesvdjBatched_bufferSize, xsyevd_bufferSize, xsyevd, spotrf, ssyevj,
               check_status):
        setattr(m, fn.__name__, fn)
    return m


@pytest.fixture
def env(monkeypatch):
    state = {"current": CAPTURE, "capturing": {CAPTURE}, "eager": [], "handles": {}, "linalg": "ignore",
             "checked": [], "status": 1}
    backend = _make_backend(state)
    cp = types.ModuleType("cupy")

    def get_cusolver_handle():
        return state["handles"].setdefault(threading.get_ident(), 0x200 + len(state["handles"]))

    class Device:
        def __init__(self, ordinal=0):
            self.ordinal = ordinal

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    cp.cuda = types.SimpleNamespace(Device=Device, device=types.SimpleNamespace(get_cusolver_handle=get_cusolver_handle),
                                    get_current_stream=lambda: types.SimpleNamespace(ptr=state["current"]))
    util = types.ModuleType("cupy.linalg._util")

    def _check_cusolver_dev_info_if_synchronization_allowed(routine, dev_info):
        state["checked"].append(routine)

    util._check_cusolver_dev_info_if_synchronization_allowed = _check_cusolver_dev_info_if_synchronization_allowed
    ufunc_config = types.ModuleType("cupyx._ufunc_config")
    ufunc_config.get_config_linalg = lambda: state["linalg"]
    for name, mod in (("cupy", cp), (S.BACKEND, backend), ("cupy.linalg._util", util),
                      ("cupyx._ufunc_config", ufunc_config)):
        monkeypatch.setitem(sys.modules, name, mod)
    routing = R.Routing()
    for name, value in (("_routing", routing), ("_routers", routing.routers), ("_patches", routing.patches),
                        ("_idle", routing.idle), ("_library_cache", [])):
        monkeypatch.setattr(S, name, value)
    dll = FakeDll()
    state.update(backend=backend, util=util, dll=dll, lib=S.Library(dll, "fake/libcusolver.so.12"))
    yield state
    assert not S._routers and not S._patches, "a test left CuPy's cuSOLVER functions replaced"


def _router(state):
    return S.Router(state["lib"], 0, CAPTURE, status=lambda: state["status"])


def _call_from_cupy(module: str, fn_name: str, call):
    """Run ``call`` from a function defined in ``module`` (as cupy.linalg's frames look)."""
    ns = {"__name__": module, "call": call}
    exec(f"def {fn_name}():\n    return call()\n", ns)
    return ns[fn_name]()


# ---------------------------------------------------------------- the table


def test_table_matches_cupy14_wrapper_signatures():
    for name, arity in CUPY14_ARITY.items():
        assert S.cupy_arity(S.SPECS[name]) == arity, name
    assert all(set(kinds) <= set(S._CTYPES) for kinds in S.SPECS.values())
    assert not set(S.SPECS) & set(S.REFUSED)
    for dtype in "sdcz":  # every precision of each routed routine
        for base in ("getrf", "getrs", "potrf", "potrs", "potrfBatched", "potrsBatched", "geqrf", "gesvdjBatched"):
            assert f"{dtype}{base}" in S.SPECS
        for base in ("gesvd", "gesvd_bufferSize"):  # synchronise inside cuSOLVER (H200, session 9)
            assert S.REFUSED[f"{dtype}{base}"] is S._HYBRID
    for name in ("ssyevd", "dsyevd", "cheevd", "zheevd", "xsyevd", "xsyevd_bufferSize", "zheevd_bufferSize"):
        assert S.REFUSED[name] is S._HYBRID
    assert S.symbol("cheevjBatched_bufferSize") == "cusolverDnCheevjBatched_bufferSize"
    assert S.symbol("xsyevd") == "cusolverDnXsyevd"


def _wheel_signatures() -> dict[str, int]:
    """name -> argument count, from the signatures Cython embedded in CuPy 14.2's cusolver module."""
    paths = glob.glob("/tmp/cupy*/cupy_backends/cuda/libs/cusolver.cpython-*.so")
    if not paths:
        pytest.skip("CuPy 14.2's wheel is not unpacked here (/tmp/cupy*/cupy_backends)")
    data = open(paths[0], "rb").read()
    out = {}
    for m in re.finditer(rb"\n?([a-zA-Z_0-9]+)\((intptr_t handle[^)]*)\)", data):
        out[m.group(1).decode()] = len(m.group(2).split(b","))
    return out


def test_table_matches_the_unpacked_wheel():
    sigs = _wheel_signatures()
    missing = [n for n in (*S.SPECS, *S.REFUSED) if n not in sigs]
    assert not missing, missing
    wrong = {n: (sigs[n], S.cupy_arity(k)) for n, k in S.SPECS.items() if sigs[n] != S.cupy_arity(k)}
    assert not wrong, wrong


def test_library_candidates_put_the_loaded_cupy_copy_first():
    maps = ("7f00-7f01 r-xp 0 08:01 1 /opt/torch/lib/libcusolver.so.12\n"
            "7f02-7f03 r-xp 0 08:01 2 /site/cupy/.data/libcusolver.so.12.0\n"
            "7f04-7f05 r-xp 0 08:01 3 /site/cupy/.data/libcusolverMg.so.12\n")
    paths = S.candidate_paths(maps)
    assert paths[:2] == ["/site/cupy/.data/libcusolver.so.12.0", "/opt/torch/lib/libcusolver.so.12"]
    assert paths[2:] == list(S.SONAMES)


def test_no_router_when_disabled_or_cupy_is_not_as_expected(env, monkeypatch):
    pool = types.SimpleNamespace(device=types.SimpleNamespace(ordinal=0))
    stream = types.SimpleNamespace(ptr=CAPTURE, capture_status=1)
    S._library_cache.append(env["lib"])
    assert isinstance(S.router(pool, stream), S.Router)
    monkeypatch.setenv("CGRAW_CUPY_CUSOLVER", "0")
    assert S.router(pool, stream) is None
    monkeypatch.delenv("CGRAW_CUPY_CUSOLVER")
    monkeypatch.delattr(sys.modules["cupy"].cuda.device, "get_cusolver_handle")
    assert S.router(pool, stream) is None


# ---------------------------------------------------------------- routing


def test_calls_of_the_capture_go_to_cgraws_handle_and_the_handle_is_reused(env):
    backend, dll = env["backend"], env["dll"]
    originals = {n: getattr(backend, n) for n in ("sgetrf", "sgetrf_bufferSize", "spotrf", "ssyevj")}
    r = _router(env)
    r.enter()
    mine, h = r.handle, r.cupy_handle
    assert mine == 0xB000 and dll.named("cusolverDnSetStream")[-1] == (mine, CAPTURE)
    assert backend.sgetrf is not originals["sgetrf"] and backend.sgetrf.__name__ == "sgetrf"
    assert backend.spotrf is originals["spotrf"]  # another shape: CuPy's, with its refusal

    assert backend.sgetrf_bufferSize(h, 4, 4, 0x1000, 4) == 77  # the int cuSOLVER wrote, as CuPy returns it
    (args,) = dll.named("cusolverDnSgetrf_bufferSize")
    assert args[:5] == (mine, 4, 4, 0x1000, 4) and isinstance(args[5]._obj, ctypes.c_int)
    assert backend.sgetrf(h, 4, 4, 0x1000, 4, 0x2000, 0x3000, 0x4000) is None
    assert dll.named("cusolverDnSgetrf") == [(mine, 4, 4, 0x1000, 4, 0x2000, 0x3000, 0x4000)]
    assert r.calls == 2 and not env["eager"]

    with pytest.raises(NotImplementedError):
        backend.sgetrf(0x999, 4, 4, 0x1000, 4, 0x2000, 0x3000, 0x4000)  # the user's own handle: CuPy's path
    env["current"] = EAGER
    backend.sgetrf(h, 4, 4, 0x1000, 4, 0x2000, 0x3000, 0x4000)  # another stream: CuPy, eagerly
    backend.ssyevj(h, 0, 0, 4, 0x1000, 4, 0x2000, 0x3000, 8, 0x4000, 0x5000)  # refused only on the capture stream
    assert env["eager"] == ["sgetrf", "ssyevj"]
    env["current"] = CAPTURE

    r.exit()
    assert all(getattr(backend, n) is f for n, f in originals.items())
    assert dll.named("cusolverDnSetStream")[-1] == (mine, 0) and S._idle == {0: [mine]}
    r2 = _router(env)
    r2.enter()
    assert r2.handle == mine and len(dll.named("cusolverDnCreate")) == 1  # reused, not created again
    r2.exit()


def test_routines_that_synchronise_inside_cusolver_never_reach_it_in_a_capture(env):
    """gesvd and syevd/Xsyevd broke the thread's next cuSOLVER call on the H200 once called inside a
    capture: refused before libcusolver is touched, with the batched hint; eager calls stay CuPy's."""
    backend, dll, state = env["backend"], env["dll"], env
    r = _router(env)
    r.enter()
    h = r.cupy_handle
    for call in (lambda: backend.xsyevd_bufferSize(h, 0x10, 1, 0, 8, 0, 0x1000, 8, 0, 0x2000, 0),
                 lambda: backend.xsyevd(h, 0x10, 1, 0, 8, 0, 0x1000, 8, 0, 0x2000, 0, 0x3000, 1024, 0x4000, 0, 0x5000)):
        with pytest.raises(CaptureError, match="synchronises with the host inside cuSOLVER") as ei:
            _call_from_cupy("cupy.linalg._eigenvalue", "_syevd", call)
        assert "cupy.linalg._eigenvalue._syevd" in ei.value.description and "batch" in ei.value.hint
        assert ei.value.name == "CUSOLVER_NOT_COVERED"
    assert not [n for n, _ in dll.calls if "syevd" in n.lower()]
    state["current"] = EAGER  # another stream: CuPy's own wrapper runs
    backend.xsyevd(h, 0x10, 1, 0, 8, 0, 0x1000, 8, 0, 0x2000, 0, 0x3000, 1024, 0x4000, 0, 0x5000)
    assert state["eager"][-1] == "xsyevd"
    r.exit()


def test_refusals_name_the_entry_point_and_the_routine(env):
    backend, dll = env["backend"], env["dll"]
    r = _router(env)
    r.enter()
    h = r.cupy_handle
    with pytest.raises(CaptureError, match="sweeps") as ei:
        _call_from_cupy("cupyx.cusolver", "syevj", lambda: backend.ssyevj(h, 0, 0, 4, 1, 4, 2, 3, 8, 4, 5))
    assert "cupyx.cusolver.syevj" in ei.value.description and "cusolverDnSsyevj" in ei.value.description
    assert "batch" in ei.value.hint

    with pytest.raises(CaptureError, match="does not fit"):
        backend.sgetrf(h, 1 << 33, 4, 0x1000, 4, 0x2000, 0x3000, 0x4000)
    env["status"] = S.CAPTURE_INVALIDATED  # cuSOLVER synchronised inside
    with pytest.raises(CaptureError, match="invalidated") as ei:
        _call_from_cupy("cupy.linalg._decomposition", "svd", lambda: backend.sgetrf(h, 4, 4, 1, 4, 2, 3, 4))
    assert "cupy.linalg._decomposition.svd" in ei.value.description
    assert "EXECUTION_FAILED" not in ei.value.description  # it returned success: nothing left behind
    dll.status["cusolverDnSgetrf"] = 7  # failed and invalidated: the stale error is announced
    with pytest.raises(CaptureError, match="INTERNAL_ERROR.*fail once with EXECUTION_FAILED"):
        backend.sgetrf(h, 4, 4, 1, 4, 2, 3, 4)
    env["status"] = 1
    dll.status["cusolverDnSgetrf"] = 7
    with pytest.raises(FakeCUSOLVERError, match="7"):  # CuPy's own error, as eager
        backend.sgetrf(h, 4, 4, 1, 4, 2, 3, 4)
    r.exit(failed=True)


def test_the_capture_turns_a_refusal_into_its_own_words(env):
    from cgraw import capture

    msg = capture(pool=None)._classify(S._not_covered("ssyevj", S._JACOBI, S.HINTS[S._JACOBI]), 0, 0)
    assert "cuSOLVER ssyevj" in msg and "cusolverDnSsyevj" in msg and "batch" in msg


def test_info_check_refuses_under_linalg_raise_naming_cusolver_and_the_routine(env):
    util, backend = env["util"], env["backend"]
    original = util._check_cusolver_dev_info_if_synchronization_allowed
    r = _router(env)
    r.enter()
    routed = util._check_cusolver_dev_info_if_synchronization_allowed
    assert routed is not original
    routed(backend.sgetrf, "info")  # linalg='ignore': CuPy's check, which returns at once
    env["linalg"] = "raise"
    with pytest.raises(CaptureError, match="linalg='ignore'") as ei:
        _call_from_cupy("cupyx.lapack", "gesv", lambda: util._check_cusolver_dev_info_if_synchronization_allowed(
            backend.sgetrf, "info"))
    assert "cuSOLVER" in ei.value.description and "sgetrf" in ei.value.description
    assert "cupyx.lapack.gesv" in ei.value.description
    r.exit()
    assert util._check_cusolver_dev_info_if_synchronization_allowed is original
    assert len(env["checked"]) == 1


def test_a_failed_enter_leaves_nothing_replaced_and_exit_after_a_failure_restores(env):
    backend, dll = env["backend"], env["dll"]
    original = backend.sgetrf
    dll.status["cusolverDnSetStream"] = 3
    r = _router(env)
    with pytest.raises(CaptureError, match="cusolverDnSetStream"):
        r.enter()
    assert not S._patches and not S._routers and r.handle is None
    dll.status.clear()
    r = _router(env)
    r.enter()
    dll.status["cusolverDnSgetrf"] = 6
    with pytest.raises(FakeCUSOLVERError):
        backend.sgetrf(r.cupy_handle, 4, 4, 1, 4, 2, 3, 4)
    mine = r.handle
    r.exit(failed=True)
    assert backend.sgetrf is original and dll.named("cusolverDnSetStream")[-1] == (mine, 0)
    assert mine in S._idle[0]


def test_two_captures_on_two_threads_use_two_handles(env):
    backend, dll = env["backend"], env["dll"]
    ready, go, done = threading.Barrier(2), threading.Event(), []

    def capture_on_thread():
        r = _router(env)
        r.enter()
        ready.wait()
        go.wait()
        backend.sgetrf(r.cupy_handle, 4, 4, 1, 4, 2, 3, 4)
        done.append(r.handle)
        r.exit()

    t = threading.Thread(target=capture_on_thread)
    t.start()
    r = _router(env)
    r.enter()
    ready.wait()
    backend.sgetrf(r.cupy_handle, 4, 4, 1, 4, 2, 3, 4)
    mine = r.handle
    r.exit()
    assert S._patches  # the other capture still routes
    go.set()
    t.join()
    assert {a[0] for a in dll.named("cusolverDnSgetrf")} == {mine, done[0]} and mine != done[0]
    assert not S._patches

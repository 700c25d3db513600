"""CPU tier of ``cgraw.interop.cupy.solver`` (CuPy's cuSOLVER calls inside captures), without CuPy or
a GPU: fakes shaped like CuPy 14's ``cupy_backends.cuda.libs.cusolver`` (Python functions with its
wrappers' signatures, its refusal on a capturing stream), ``cupy`` (devices, streams, handles),
``cupy.linalg._util``'s info check, and a ctypes library that records its calls. The table is also
checked against the signatures embedded in CuPy 14.2's wheel when it is unpacked here. What these
cannot show (cuSOLVER in a real capture, replayed) is tests/gpu/test_cupy_libs.py."""

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
from cgraw.interop.cupy import solver as S

CAPTURE, EAGER = 0x5000, 0x6000

# argument counts of CuPy 14.2's wrappers (cupy_backends/cuda/libs/cusolver.pyx), the handle included
CUPY14_ARITY = {"sgetrf_bufferSize": 5, "sgetrf": 8, "zgetrs": 10, "spotrf_bufferSize": 5, "dpotrf": 8,
                "cpotrs": 9, "spotrfBatched": 7, "zpotrsBatched": 10, "sgeqrf_bufferSize": 5, "dgeqrf": 9,
                "sorgqr_bufferSize": 7, "cungqr": 10, "dormqr_bufferSize": 11, "zunmqr": 14,
                "sgesvdjBatched_bufferSize": 13, "dgesvdjBatched": 16, "ssyevjBatched_bufferSize": 9,
                "zheevjBatched": 12}


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

    def ssyevd(handle, jobz, uplo, n, A, lda, W, work, lwork, devInfo):  # ROCm only in CuPy: refused by name
        refuse_or_run("ssyevd", locals())

    def check_status(status):
        raise FakeCUSOLVERError(f"CUSOLVER_STATUS {status}")

    for fn in (sgetrf_bufferSize, sgetrf, sgesvdjBatched_bufferSize, xsyevd_bufferSize, xsyevd, spotrf, ssyevj,
               ssyevd, check_status):
        setattr(m, fn.__name__, fn)
    for p in "sdcz":
        for fn in _gesvd_fakes(p, refuse_or_run):
            setattr(m, fn.__name__, fn)
    return m


def _gesvd_fakes(p, refuse_or_run):
    def gesvd_bufferSize(handle, m, n):
        refuse_or_run(p + "gesvd_bufferSize", locals())
        return 5

    def gesvd(handle, jobu, jobvt, m, n, A, lda, S, U, ldu, VT, ldvt, Work, lwork, rwork, devInfo):
        refuse_or_run(p + "gesvd", locals())

    gesvd_bufferSize.__name__, gesvd.__name__ = p + "gesvd_bufferSize", p + "gesvd"
    return gesvd_bufferSize, gesvd


@pytest.fixture
def env(monkeypatch):
    state = {"current": CAPTURE, "capturing": {CAPTURE}, "eager": [], "handles": {}, "linalg": "ignore",
             "checked": [], "status": 1}
    backend = _make_backend(state)
    cp = types.ModuleType("cupy")

    def get_cusolver_handle():
        return state["handles"].setdefault(threading.get_ident(), 0x200 + len(state["handles"]))


    cp.cuda = types.SimpleNamespace(Device=FakeDevice,
                                    device=types.SimpleNamespace(get_cusolver_handle=get_cusolver_handle),
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
    fresh_routing(monkeypatch, S)
    dll = FakeDll("cusolverDn", lambda name: name.startswith("cusolverDnCreate"), 0xB000, 77,
                  (ctypes.c_int, ctypes.c_size_t))  # creates the handle or a Jacobi info structure
    state.update(backend=backend, util=util, dll=dll, lib=S.Library(dll, "fake/libcusolver.so.12"))
    yield state
    assert not S._routers and not S._patches, "a test left CuPy's cuSOLVER functions replaced"


def _router(state):
    return S.Router(state["lib"], 0, CAPTURE, status=lambda: state["status"])



# ---------------------------------------------------------------- the table


def test_table_matches_cupy14_wrapper_signatures():
    for name, arity in CUPY14_ARITY.items():
        assert S.cupy_arity(S.SPECS[name]) == arity, name
    assert all(set(kinds) <= set(S._CTYPES) for kinds in S.SPECS.values())
    assert not set(S.SPECS) & set(S.REFUSED)
    for dtype in "sdcz":  # every precision of each routed routine
        for base in ("getrf", "getrs", "potrf", "potrs", "potrfBatched", "potrsBatched", "geqrf", "gesvdjBatched"):
            assert f"{dtype}{base}" in S.SPECS
        for base in ("gesvd", "gesvd_bufferSize"):  # synchronise inside cuSOLVER (H200): gesvdjBatched instead
            assert S.SUBSTITUTED[f"{dtype}{base}"] == base and f"{dtype}{base}" not in S.REFUSED
    for name in ("ssyevd", "dsyevd", "cheevd", "zheevd", "zheevd_bufferSize"):  # ROCm only in CuPy
        assert S.REFUSED[name] is S._HYBRID
    assert S.SUBSTITUTED["xsyevd"] == "xsyevd" and "xsyevd_bufferSize" in S.SUBSTITUTED
    assert not set(S.SUBSTITUTED) & (set(S.SPECS) | set(S.REFUSED))
    arity = {"sgesvd_bufferSize": 3, "zgesvd": 16, "xsyevd_bufferSize": 11, "xsyevd": 16}  # CuPy 14.2's
    assert all(S.SUBSTITUTED_ARITY[S.SUBSTITUTED[n]] == a for n, a in arity.items())
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
    missing = [n for n in (*S.SPECS, *S.REFUSED, *S.SUBSTITUTED) if n not in sigs]
    assert not missing, missing
    wrong = {n: sigs[n] for n, how in S.SUBSTITUTED.items() if sigs[n] != S.SUBSTITUTED_ARITY[how]}
    assert not wrong, wrong
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
    capture: over 32x32 (and ?syevd, ROCm-only in CuPy) refused before libcusolver is touched, naming the
    size; eager calls stay CuPy's."""
    backend, dll, state = env["backend"], env["dll"], env
    r = _router(env)
    r.enter()
    h = r.cupy_handle
    for call in (lambda: backend.xsyevd_bufferSize(h, 0x10, 1, 0, 33, 0, 0x1000, 33, 0, 0x2000, 0),
                 lambda: backend.xsyevd(h, 0x10, 1, 0, 33, 0, 0x1000, 33, 0, 0x2000, 0, 0x3000, 1024, 0x4000, 0,
                                        0x5000)):
        with pytest.raises(CaptureError, match="33x33: up to 32x32 is routed through the Jacobi routine; "
                                               "larger: do it outside the capture") as ei:
            _call_from_cupy("cupy.linalg._eigenvalue", "_syevd", call)
        assert "cupy.linalg._eigenvalue._syevd" in ei.value.description and "xsyevd" in ei.value.description
        assert ei.value.name == "CUSOLVER_NOT_COVERED"
    for call in (lambda: backend.dgesvd_bufferSize(h, 40, 8),
                 lambda: backend.zgesvd(h, 65, 65, 8, 33, 1, 8, 2, 3, 8, 4, 33, 5, 99, 0, 6)):
        with pytest.raises(CaptureError, match="up to 32x32 is routed through the Jacobi routine"):
            _call_from_cupy("cupy.linalg._decomposition", "svd", call)
    with pytest.raises(CaptureError, match="synchronises with the host inside cuSOLVER") as ei:
        backend.ssyevd(h, 1, 0, 8, 0x1000, 8, 0x2000, 0x3000, 64, 0x4000)
    assert "batch" in ei.value.hint
    assert not [n for n, _ in dll.calls if "syev" in n.lower() or "gesvd" in n.lower()]
    state["current"] = EAGER  # another stream: CuPy's own wrapper runs
    backend.xsyevd(h, 0x10, 1, 0, 8, 0, 0x1000, 8, 0, 0x2000, 0, 0x3000, 1024, 0x4000, 0, 0x5000)
    backend.sgesvd_bufferSize(h, 40, 40)
    assert state["eager"][-2:] == ["xsyevd", "sgesvd_bufferSize"]
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


# ---------------------------------------------------------------- gesvd and Xsyevd through the Jacobi routines
# The fake libcusolver runs gesvdjBatched and syevjBatched on host memory with NumPy (pointers are host
# addresses here), with vectors of random sign/phase as the Jacobi routine may give; the router's copies run
# on NumPy views instead of CuPy's. CuPy 14.2's svd and _syevd are replayed line by line against the
# substituted wrappers, so the argument translation (sizes, jobs, leading dimensions, conj) is checked end
# to end. Not checked here: cuSOLVER itself and CuPy's elementwise copies on the capture stream (GPU tier).

np = pytest.importorskip("numpy")
_NP = {"s": np.float32, "d": np.float64, "c": np.complex64, "z": np.complex128}
_CUDA_TYPE = {"s": 0, "d": 1, "c": 4, "z": 5}


def _host_view(ptr, dtype, rows, cols, ld, device=0):
    """A NumPy view of the column-major rows x cols matrix at host address ``ptr`` (the fake _device_array)."""
    dt = np.dtype(dtype)
    count = (cols - 1) * ld + rows
    flat = np.frombuffer((ctypes.c_char * (count * dt.itemsize)).from_address(int(ptr)), dt)
    return np.lib.stride_tricks.as_strided(flat, (rows, cols), (dt.itemsize, ld * dt.itemsize))


def _phases(rng, n, dtype):
    if np.dtype(dtype).kind == "c":
        return np.exp(1j * rng.uniform(0, 2 * np.pi, n)).astype(dtype)
    return rng.choice([-1.0, 1.0], n).astype(dtype)


def _emulate_jacobi(dll, rng):
    seen = {}

    def gesvdj(p):
        def run(handle, jobz, m, n, A, lda, s_ptr, U, ldu, V, ldv, work, lwork, info, params, batch):
            assert batch == 1 and params and max(m, n) <= 32
            a = _host_view(A, _NP[p], m, n, lda)
            u, s, vh = np.linalg.svd(a.astype(np.complex128 if p in "cz" else np.float64))
            k = min(m, n)
            ph = _phases(rng, max(m, n), _NP[p])
            u[:, :k] *= ph[:k]  # U_i and V_i share a phase: U diag(S) V^H unchanged
            v = vh.conj().T
            v[:, :k] *= ph[:k]
            if m > k:
                u[:, k:] *= ph[k:m]
            if n > k:
                v[:, k:] *= ph[k:n]
            _host_view(s_ptr, _NP[p](0).real.dtype, k, 1, k)[:, 0] = s
            if jobz == S.EIG_MODE_VECTOR:
                _host_view(U, _NP[p], m, m, ldu)[...] = u
                _host_view(V, _NP[p], n, n, ldv)[...] = v
            a[...] = np.nan  # A is destroyed
            seen.setdefault("gesvdj", []).append(dict(jobz=jobz, m=m, n=n, lda=lda, ldu=ldu, ldv=ldv, lwork=lwork,
                                                      U=U, V=V, work=work))
        return run

    def syevj(p):
        def run(handle, jobz, uplo, n, A, lda, W, work, lwork, info, params, batch):
            assert batch == 1 and params and n <= 32
            a = _host_view(A, _NP[p], n, n, lda)
            w, v = np.linalg.eigh(a, UPLO="L" if uplo == 0 else "U")
            _host_view(W, _NP[p](0).real.dtype, n, 1, n)[:, 0] = w
            if jobz == S.EIG_MODE_VECTOR:
                a[...] = v * _phases(rng, n, _NP[p])
            seen.setdefault("syevj", []).append(dict(jobz=jobz, uplo=uplo, n=n, lda=lda, lwork=lwork))
        return run

    for p in "sdcz":
        dll.impl[S.symbol(p + "gesvdjBatched")] = gesvdj(p)
        dll.impl[S.symbol(S._EIGJ[p])] = syevj(p)
    return seen


@pytest.fixture
def jac(env, monkeypatch):
    monkeypatch.setattr(S, "_device_array", _host_view)
    monkeypatch.setattr(S, "_jacobi_params", {})
    sys.modules["cupy"].conjugate = np.conjugate
    env["seen"] = _emulate_jacobi(env["dll"], np.random.default_rng(7))
    env["dll"].out_value = 40  # what the fake's _bufferSize queries answer
    r = _router(env)
    r.enter()
    env["router"] = r
    yield env
    r.exit()


def _cupy_svd(backend, handle, a, full_matrices=True, compute_uv=True):
    """CuPy 14.2's cupy.linalg.svd (cupy/linalg/_decomposition.py) on host arrays, single matrix."""
    dtype = a.dtype.char
    n, m = a.shape
    if m >= n:
        x = a.astype(dtype, order="C", copy=True)
        trans_flag = False
    else:
        m, n = a.shape
        x = a.transpose().astype(dtype, order="C", copy=True)
        trans_flag = True
    k = n
    if compute_uv:
        if full_matrices:
            u = np.empty((m, m), dtype=dtype)
            vt = x[:, :n]
            job_u, job_vt = ord("A"), ord("O")
        else:
            u = x
            vt = np.empty((k, n), dtype=dtype)
            job_u, job_vt = ord("O"), ord("S")
        u_ptr, vt_ptr = u.ctypes.data, vt.ctypes.data
    else:
        u_ptr, vt_ptr = 0, 0
        job_u = job_vt = ord("N")
    s = np.empty(k, dtype=dtype.lower())
    dev_info = np.empty(1, dtype=np.int32)
    p = {"f": "s", "d": "d", "F": "c", "D": "z"}[dtype]
    gesvd, gesvd_bufferSize = getattr(backend, p + "gesvd"), getattr(backend, p + "gesvd_bufferSize")
    buffersize = gesvd_bufferSize(handle, m, n)
    workspace = np.empty(buffersize, dtype=dtype)
    gesvd(handle, job_u, job_vt, m, n, x.ctypes.data, m, s.ctypes.data, u_ptr, m, vt_ptr, n, workspace.ctypes.data,
          buffersize, 0, dev_info.ctypes.data)
    if compute_uv:
        return (u.transpose(), s, vt.transpose()) if trans_flag else (vt, s, u)
    return s


def _check_svd(a, out, full_matrices, compute_uv):
    want_s = np.linalg.svd(a.astype(np.complex128), compute_uv=False)
    tol = 1e-4 if a.dtype in (np.float32, np.complex64) else 1e-10
    if not compute_uv:
        np.testing.assert_allclose(out, want_s, rtol=tol, atol=tol)
        return
    u, s, vt = out
    m, n = a.shape
    k = min(m, n)
    np.testing.assert_allclose(s, want_s, rtol=tol, atol=tol)
    assert u.shape == ((m, m) if full_matrices else (m, k)) and vt.shape == ((n, n) if full_matrices else (k, n))
    np.testing.assert_allclose(u.conj().T @ u, np.eye(u.shape[1]), atol=tol * 10)
    np.testing.assert_allclose(vt @ vt.conj().T, np.eye(vt.shape[0]), atol=tol * 10)
    np.testing.assert_allclose((u[:, :k] * s) @ vt[:k], a, atol=tol * 10 * max(1, np.abs(a).max()))


@pytest.mark.parametrize("p", list("sdcz"))
@pytest.mark.parametrize("shape", [(12, 12), (20, 7), (7, 20), (32, 32), (1, 5)])
@pytest.mark.parametrize("uv", ["full", "reduced", "values"])
def test_gesvd_runs_as_gesvdj_batched_and_gives_gesvds_factors(jac, p, shape, uv):
    rng = np.random.default_rng(3)
    a = rng.standard_normal(shape)
    if p in "cz":
        a = a + 1j * rng.standard_normal(shape)
    a = a.astype(_NP[p])
    full, compute_uv = uv == "full", uv != "values"
    out = _cupy_svd(jac["backend"], jac["router"].cupy_handle, a, full, compute_uv)
    _check_svd(a, out, full, compute_uv)
    assert not jac["eager"]
    (call,) = jac["seen"]["gesvdj"]
    m, n = max(shape), min(shape)  # CuPy transposes so that m >= n
    assert (call["m"], call["n"], call["lda"], call["ldu"], call["ldv"]) == (m, n, m, m, n)
    assert call["jobz"] == (S.EIG_MODE_VECTOR if compute_uv else S.EIG_MODE_NOVECTOR)
    # U and V scratch carved from CuPy's workspace after the Jacobi routine's own (40, rounded up to 256 bytes)
    isz, align = S._ITEMSIZE[p], 256 // S._ITEMSIZE[p]
    jac_elems = -(-40 // align) * align
    assert call["lwork"] == jac_elems
    assert call["U"] == call["work"] + jac_elems * isz and call["V"] == call["U"] + m * m * isz
    sizes = [args for name, args in jac["dll"].calls if name == S.symbol(p + "gesvdjBatched_bufferSize")]
    assert sizes and all(a_[1:4] == (S.EIG_MODE_VECTOR, m, n) and a_[4] == 0 and a_[13] == 1 for a_ in sizes)


def test_gesvd_buffer_size_is_jacobis_plus_u_and_v(jac):
    backend, h, dll = jac["backend"], jac["router"].cupy_handle, jac["dll"]
    dll.out_value = 100
    assert backend.sgesvd_bufferSize(h, 16, 8) == 128 + 16 * 16 + 8 * 8  # 100 rounded up to 64 float32s
    assert backend.zgesvd_bufferSize(h, 16, 8) == 112 + 16 * 16 + 8 * 8  # 100 rounded up to 16 complex128s
    (args,) = [a for n, a in dll.calls if n == "cusolverDnSgesvdjBatched_bufferSize"][:1]
    assert args[1:4] == (S.EIG_MODE_VECTOR, 16, 8) and args[4] == 0 and args[13] == 1  # NULL A, a batch of 1
    assert args[12] == S._jacobi_params[(jac["router"].handle, "Gesvdj")]
    # one info structure for cgraw's handle, made once
    assert len(dll.named("cusolverDnCreateGesvdjInfo")) == 1 and len(S._jacobi_params) == 1


def test_gesvd_jobs_write_where_gesvd_would(jac):
    """jobu/jobvt 'A', 'S', 'O', 'N' directly (CuPy uses A+O, O+S, N+N): results land in U, VT or A."""
    backend, h = jac["backend"], jac["router"].cupy_handle
    rng = np.random.default_rng(5)
    m, n = 9, 6
    for jobu, jobvt in (("A", "A"), ("S", "S"), ("S", "O"), ("N", "A"), ("A", "N")):
        a0 = rng.standard_normal((m, n)) + 1j * rng.standard_normal((m, n))
        a = np.asfortranarray(a0.astype(np.complex128))
        lda, ldu, ldvt = m + 2, m + 1, n + 3  # leading dimensions larger than the matrices
        abuf = np.zeros((n, lda), np.complex128)  # column-major with lda
        abuf[:, :m] = a.T
        s = np.empty(n, np.float64)
        u = np.full((m, ldu), 7.0 + 0j)  # column-major m columns of ldu
        vt = np.full((n, ldvt), 7.0 + 0j)
        info = np.zeros(1, np.int32)
        lwork = backend.zgesvd_bufferSize(h, m, n)
        work = np.empty(lwork, np.complex128)
        backend.zgesvd(h, ord(jobu), ord(jobvt), m, n, abuf.ctypes.data, lda, s.ctypes.data, u.ctypes.data, ldu,
                       vt.ctypes.data, ldvt, work.ctypes.data, lwork, 0, info.ctypes.data)
        uc = {"A": m, "S": n, "O": n}.get(jobu, 0)
        vr = {"A": n, "S": n, "O": n}.get(jobvt, 0)
        U = (_host_view(abuf.ctypes.data, "complex128", m, uc, lda) if jobu == "O" else u.T[:m, :uc]) if uc else None
        VT = (_host_view(abuf.ctypes.data, "complex128", vr, n, lda) if jobvt == "O" else vt.T[:vr, :n]) if vr else None
        np.testing.assert_allclose(s, np.linalg.svd(a0, compute_uv=False), rtol=1e-12)
        if U is not None:
            np.testing.assert_allclose(U.conj().T @ U, np.eye(uc), atol=1e-12)
        if VT is not None:
            np.testing.assert_allclose(VT @ VT.conj().T, np.eye(vr), atol=1e-12)
        if U is not None and VT is not None:
            np.testing.assert_allclose((U[:, :n] * s) @ VT[:n], a0, atol=1e-12)
        if jobu == "N":
            assert np.all(u == 7.0)  # untouched
        if jobu in "AS" and uc < ldu:
            assert np.all(u[:, m:] == 7.0)  # nothing written past each column
        if jobvt in "AS":
            assert np.all(vt[:, vr:] == 7.0)


def test_gesvd_with_a_workspace_too_small_or_bad_arguments(jac):
    backend, h = jac["backend"], jac["router"].cupy_handle
    m = n = 8
    a, s, u, vt = (np.zeros((8, 8), np.float32) for _ in range(4))
    info = np.zeros(1, np.int32)
    work = np.empty(1000, np.float32)
    with pytest.raises(CaptureError, match="workspace has 10 elements"):  # sized outside the capture?
        backend.sgesvd(h, ord("A"), ord("A"), m, n, a.ctypes.data, m, s.ctypes.data, u.ctypes.data, m,
                       vt.ctypes.data, n, work.ctypes.data, 10, 0, info.ctypes.data)
    for jobu, jobvt, lda in (("O", "O", 8), ("A", "A", 4), ("X", "A", 8)):
        with pytest.raises(FakeCUSOLVERError, match="3"):  # INVALID_VALUE, as gesvd reports it
            backend.sgesvd(h, ord(jobu), ord(jobvt), m, n, a.ctypes.data, lda, s.ctypes.data, u.ctypes.data, m,
                           vt.ctypes.data, n, work.ctypes.data, 1000, 0, info.ctypes.data)
    assert "gesvdj" not in jac["seen"]


def _cupy_syevd(backend, handle, a, UPLO, with_eigen_vector):
    """CuPy 14.2's cupy/linalg/_eigenvalue.py::_syevd on the CUDA path, on host arrays."""
    dtype = a.dtype.char
    real_dtype = dtype.lower()
    v = a.astype(dtype, order="F", copy=True)
    m, lda = a.shape
    w = np.empty(m, real_dtype)
    dev_info = np.empty((), np.int32)
    jobz = 1 if with_eigen_vector else 0
    uplo = 0 if UPLO == "L" else 1
    p = {"f": "s", "d": "d", "F": "c", "D": "z"}[dtype]
    type_v, type_w = _CUDA_TYPE[p], _CUDA_TYPE[S._REAL[p]]
    params = 0x77
    work_device_size, work_host_size = backend.xsyevd_bufferSize(handle, params, jobz, uplo, m, type_v, v.ctypes.data,
                                                                 lda, type_w, w.ctypes.data, type_v)
    work_device = np.empty(work_device_size, "b")
    work_host = np.empty(work_host_size, "b")
    backend.xsyevd(handle, params, jobz, uplo, m, type_v, v.ctypes.data, lda, type_w, w.ctypes.data, type_v,
                   work_device.ctypes.data, work_device_size, work_host.ctypes.data, work_host_size,
                   dev_info.ctypes.data)
    return w, v, work_device_size, work_host_size


@pytest.mark.parametrize("p", list("sdcz"))
@pytest.mark.parametrize("uplo", ["L", "U"])
@pytest.mark.parametrize("vectors", [True, False])
def test_xsyevd_runs_as_syevj_batched(jac, p, uplo, vectors):
    rng = np.random.default_rng(11)
    n = 10
    x = rng.standard_normal((n, n)) + (1j * rng.standard_normal((n, n)) if p in "cz" else 0)
    a = (x + x.conj().T).astype(_NP[p])
    tri = np.tril(a) if uplo == "L" else np.triu(a)  # only that triangle is read
    junk = a.copy()
    junk[np.triu_indices(n, 1) if uplo == "L" else np.tril_indices(n, -1)] = 99
    w, v, dev_bytes, host_bytes = _cupy_syevd(jac["backend"], jac["router"].cupy_handle, junk, uplo, vectors)
    assert (dev_bytes, host_bytes) == (40 * S._ITEMSIZE[p], 0)  # syevjBatched's lwork, in bytes
    tol = 1e-4 if p in "sc" else 1e-10
    np.testing.assert_allclose(w, np.linalg.eigvalsh(a), rtol=tol, atol=tol * 10)
    if vectors:
        np.testing.assert_allclose(a @ v, v * w, atol=tol * 100)
        np.testing.assert_allclose(v.conj().T @ v, np.eye(n), atol=tol * 10)
    (call,) = jac["seen"]["syevj"]
    assert call == dict(jobz=int(vectors), uplo=0 if uplo == "L" else 1, n=n, lda=n, lwork=40)
    assert np.allclose(tri, np.tril(a) if uplo == "L" else np.triu(a))
    assert len(jac["dll"].named("cusolverDnCreateSyevjInfo")) == 1 and not jac["eager"]


def test_xsyevd_with_types_it_does_not_cover_or_a_small_workspace_is_refused(jac):
    backend, h = jac["backend"], jac["router"].cupy_handle
    with pytest.raises(CaptureError, match="data types"):  # float16 A
        backend.xsyevd_bufferSize(h, 1, 1, 0, 8, 2, 0x1000, 8, 2, 0x2000, 2)
    with pytest.raises(CaptureError, match="data types"):  # W not A's real type
        backend.xsyevd_bufferSize(h, 1, 1, 0, 8, 5, 0x1000, 8, 5, 0x2000, 5)
    with pytest.raises(CaptureError, match="needs 160"):
        backend.xsyevd(h, 1, 1, 0, 8, 0, 0x1000, 8, 0, 0x2000, 0, 0x3000, 100, 0x4000, 0, 0x5000)
    assert "syevj" not in jac["seen"]

"""CPU tier of ``cgraw.interop.cupy.blas`` (CuPy's cuBLAS calls inside captures), without CuPy or a
GPU: fakes shaped like CuPy 14's ``cupy_backends.cuda.libs.cublas`` (Python functions with its
wrappers' signatures, its refusal on a capturing stream), ``cupy`` (devices, streams, handles,
``empty``), ``cupy.linalg._util``'s info checks, and a ctypes library that records its calls.
What these cannot show (cuBLAS in a real capture, its kernels replayed) is tests/gpu/test_cupy_libs.py."""

from __future__ import annotations

import sys
import threading
import types

import cupy_lib_fakes
import pytest

from cgraw.errors import CaptureError
from cgraw.interop.cupy import blas as B

CAPTURE = 0x5000  # the capture stream's handle
EAGER = 0x6000  # another stream


# ---------------------------------------------------------------- fakes


class FakeDll(cupy_lib_fakes.FakeDll):
    """Exports ``symbols``; records every call as (symbol, args)."""

    def __init__(self, symbols):
        super().__init__("cublas", lambda name: name == "cublasCreate_v2", 0xA000)
        self.symbols = set(symbols)

    def __getattr__(self, name):
        if name.startswith("_") or name not in self.__dict__["symbols"]:
            raise AttributeError(name)
        fn = cupy_lib_fakes.FakeFn(self, name)
        setattr(self, name, fn)
        return fn

    def named(self, prefix):
        return [args for name, args in self.calls if name.startswith(prefix)]


SYMBOLS = ["cublasCreate_v2", "cublasSetStream_v2", "cublasSetWorkspace_v2", "cublasSetPointerMode_v2",
           "cublasSetMathMode", "cublasSgemm_v2", "cublasSgemm", "cublasSgemm_v2_64", "cublasGemmEx",
           "cublasGemmEx_64", "cublasSdot_v2", "cublasSgetrfBatched", "cublasGemmStridedBatchedEx"]


class FakeCUBLASError(RuntimeError):
    pass


def _make_backend(state):
    """Functions with CuPy 14's signatures: each refuses a capturing current stream, as CuPy does."""
    m = types.ModuleType(B.BACKEND)

    def refuse_or_run(name, args):
        if state["current"] in state["capturing"]:
            raise NotImplementedError("calling cuBLAS API during stream capture is currently unsupported")
        state["eager"].append((name, args))

    def sgemm(handle, transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc):
        refuse_or_run("sgemm", locals())

    def gemmEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
               computeType, algo):
        refuse_or_run("gemmEx", locals())

    def sdot(handle, n, x, incx, y, incy, result):
        refuse_or_run("sdot", locals())

    def sgetrfBatched(handle, n, Aarray, lda, PivotArray, infoArray, batchSize):
        refuse_or_run("sgetrfBatched", locals())

    def sgemv(handle, trans, m, n):  # another shape than cgraw's table: must stay CuPy's
        refuse_or_run("sgemv", locals())

    def isamax(handle, n, x, incx, result):  # not in cgraw's table
        refuse_or_run("isamax", locals())

    def getPointerMode(handle):
        return state["modes"].setdefault(handle, [0, 0])[0]

    def setPointerMode(handle, mode):
        state["modes"].setdefault(handle, [0, 0])[0] = mode

    def getMathMode(handle):
        return state["modes"].setdefault(handle, [0, 0])[1]

    def setMathMode(handle, mode):
        state["modes"].setdefault(handle, [0, 0])[1] = mode

    def check_status(status):
        raise FakeCUBLASError(f"CUBLAS_STATUS {status}")

    for fn in (sgemm, gemmEx, sdot, sgetrfBatched, sgemv, isamax, getPointerMode, setPointerMode, getMathMode,
               setMathMode, check_status):
        setattr(m, fn.__name__, fn)
    return m


class FakeArray:
    def __init__(self, ptr, nbytes):
        self.data = types.SimpleNamespace(ptr=ptr)
        self.nbytes = nbytes


def _make_cupy(state):
    cp = types.ModuleType("cupy")
    cp.float32, cp.uint8 = "float32", "uint8"

    def get_cublas_handle():
        return state["handles"].setdefault(threading.get_ident(), 0x100 + len(state["handles"]))

    cp.cuda = types.SimpleNamespace(
        Device=cupy_lib_fakes.FakeDevice,
        device=types.SimpleNamespace(get_cublas_handle=get_cublas_handle),
        get_current_stream=lambda: types.SimpleNamespace(ptr=state["current"]))

    def empty(shape, dtype=None):
        n = shape[0] if isinstance(shape, tuple) else shape
        state["allocs"].append(n)
        return FakeArray(0x7000000 + 0x10000 * len(state["allocs"]), n)

    cp.empty = cp.zeros = empty
    return cp


@pytest.fixture
def env(monkeypatch):
    """Fake CuPy modules in sys.modules, fresh module state in interop.cupy.blas; the state dict drives them."""
    state = {"current": CAPTURE, "capturing": {CAPTURE}, "eager": [], "modes": {}, "handles": {}, "allocs": [],
             "linalg": "ignore", "checked": []}
    backend = _make_backend(state)
    util = types.ModuleType("cupy.linalg._util")

    def _check_cublas_info_array_if_synchronization_allowed(routine, info_array):
        state["checked"].append(("cublas", routine))

    def _check_cusolver_dev_info_if_synchronization_allowed(routine, dev_info):
        state["checked"].append(("cusolver", routine))

    util._check_cublas_info_array_if_synchronization_allowed = _check_cublas_info_array_if_synchronization_allowed
    util._check_cusolver_dev_info_if_synchronization_allowed = _check_cusolver_dev_info_if_synchronization_allowed
    ufunc_config = types.ModuleType("cupyx._ufunc_config")
    ufunc_config.get_config_linalg = lambda: state["linalg"]
    for name, mod in (("cupy", _make_cupy(state)), (B.BACKEND, backend), ("cupy.linalg._util", util),
                      ("cupyx._ufunc_config", ufunc_config)):
        monkeypatch.setitem(sys.modules, name, mod)
    cupy_lib_fakes.fresh_routing(monkeypatch, B)
    dll = FakeDll(SYMBOLS)
    state.update(backend=backend, util=util, dll=dll, lib=B.Library(dll, "fake/libcublas.so.13"))
    yield state
    assert not B._routers and not B._patches, "a test left CuPy's cuBLAS functions replaced"


def _router(state, **kw):
    kw.setdefault("workspace", 1 << 20)
    return B.Router(state["lib"], 0, CAPTURE, **kw)


def _sgemm_args(handle):
    return (handle, 0, 0, 4, 4, 4, 0x10, 0x1000, 4, 0x2000, 4, 0x20, 0x3000, 4)


# ---------------------------------------------------------------- the table and the library


# argument counts of CuPy 14's wrappers in cupy_backends/cuda/libs/cublas.pyx, the handle included
CUPY14_ARITY = {"sgemm": 14, "zgemm": 14, "sgemmBatched": 15, "sgemmStridedBatched": 18, "sgemmEx": 17,
                "gemmEx": 19, "gemmStridedBatchedEx": 23, "sgemv": 12, "ssbmv": 12, "sger": 10, "cgerc": 10,
                "sdot": 7, "zdotc": 7, "snrm2": 5, "dzasum": 5, "saxpy": 7, "sscal": 5, "strsm": 12,
                "strsmBatched": 13, "ssyrk": 11, "sgeam": 13, "sdgmm": 10, "sgetrfBatched": 7,
                "sgetrsBatched": 11, "sgetriBatched": 9}


def test_table_matches_cupy14_wrapper_signatures():
    for name, arity in CUPY14_ARITY.items():
        assert len(B.SPECS[name]) + 1 == arity, name
    assert all(set(kinds) <= set(B._CTYPES) for kinds in B.SPECS.values())
    assert all(kinds.count("E") <= 1 and kinds.count("r") <= 1 for kinds in B.SPECS.values())
    assert "isamax" not in B.SPECS and "iamax" not in B.SPECS  # the result's width follows CuPy's build


def test_library_prefers_v2_symbols_and_takes_64bit_ones_for_large_ints():
    dll = FakeDll(SYMBOLS)
    lib = B.Library(dll, "x")
    assert lib.function("sgemm", B.SPECS["sgemm"]).name == "cublasSgemm_v2"  # never the legacy cublasSgemm
    wide = lib.function("sgemm", B.SPECS["sgemm"], True)
    assert wide.name == "cublasSgemm_v2_64" and len(wide.argtypes) == 14
    assert lib.function("gemmEx", B.SPECS["gemmEx"]).name == "cublasGemmEx"
    assert lib.function("gemmEx", B.SPECS["gemmEx"], True).name == "cublasGemmEx_64"
    with pytest.raises(CaptureError, match="no entry point") as ei:
        lib.function("dgemm", B.SPECS["dgemm"])
    assert ei.value.name == "CUBLAS_NOT_COVERED"
    h = lib.create()
    assert h == 0xA000 and dll.named("cublasCreate_v2")
    dll.status["cublasSetStream_v2"] = 7
    with pytest.raises(CaptureError, match="INVALID_VALUE"):
        lib.set_stream(h, CAPTURE)
    with pytest.raises(CaptureError, match="SYMBOL_MISSING"):
        B.Library(FakeDll([]), "empty").create()


def test_compute_types_migrate_as_cublas_overloads_do():
    assert B.migrate_compute_type(68, 0) == 68 and B.migrate_compute_type(77, 2) == 77  # already compute types
    assert B.migrate_compute_type(0, 0) == 68 and B.migrate_compute_type(4, 0) == 68  # CUDA_R_32F, CUDA_C_32F
    assert B.migrate_compute_type(1, 0) == 70 and B.migrate_compute_type(5, 0) == 70  # CUDA_R_64F, CUDA_C_64F
    assert B.migrate_compute_type(2, 0) == 64 and B.migrate_compute_type(10, 0) == 72  # CUDA_R_16F, CUDA_R_32I
    assert B.migrate_compute_type(0, 2) == 69 and B.migrate_compute_type(1, 0x12) == 71  # pedantic math
    assert B.migrate_compute_type(14, 0) is None  # CUDA_R_16BF: cuBLAS says NOT_SUPPORTED


def test_workspace_size_follows_the_environment_then_torchs_defaults():
    assert B.workspace_nbytes(9, {}) == 32 << 20 and B.workspace_nbytes(10, {}) == 32 << 20
    assert B.workspace_nbytes(8, {}) == 4096 * 1024 * 2 + 16 * 1024 * 8
    assert B.workspace_nbytes(9, {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 << 20
    assert B.workspace_nbytes(9, {"CUBLAS_WORKSPACE_CONFIG": ":16:8:4096:2"}) == (16 * 8 + 4096 * 2) * 1024
    assert B.workspace_nbytes(9, {"CUBLAS_WORKSPACE_CONFIG": "junk"}) == 32 << 20
    assert B.workspace_nbytes(9, {"CGRAW_CUBLAS_WORKSPACE_BYTES": "0", "CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 0


def test_library_candidates_put_the_loaded_cupy_copy_first():
    maps = ("7f00-7f01 r-xp 0 08:01 1 /opt/torch/lib/libcublas.so.13\n"
            "7f02-7f03 r-xp 0 08:01 2 /site/cupy/.data/libcublas.so.13.1\n"
            "7f04-7f05 r-xp 0 08:01 3 /site/cupy/.data/libcublasLt.so.13\n"
            "7f06-7f07 r-xp 0 08:01 2 /site/cupy/.data/libcublas.so.13.1\n"
            "7f08-7f09 rw-p 0 00:00 0 [heap]\n")
    paths = B.candidate_paths(maps)
    assert paths[:2] == ["/site/cupy/.data/libcublas.so.13.1", "/opt/torch/lib/libcublas.so.13"]
    assert paths[2:] == ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]


def test_no_router_when_disabled_or_cupy_is_not_as_expected(env, monkeypatch):
    pool = types.SimpleNamespace(device=types.SimpleNamespace(ordinal=0))
    stream = types.SimpleNamespace(ptr=CAPTURE)
    B._library_cache.append(env["lib"])
    assert isinstance(B.router(pool, stream), B.Router)
    monkeypatch.setenv("CGRAW_CUPY_CUBLAS", "0")
    assert B.router(pool, stream) is None
    monkeypatch.delenv("CGRAW_CUPY_CUBLAS")
    monkeypatch.delattr(env["backend"], "getMathMode")
    assert B.router(pool, stream) is None
    monkeypatch.setitem(sys.modules, B.BACKEND, None)  # import fails
    assert B.router(pool, stream) is None


# ---------------------------------------------------------------- routing


def test_calls_of_the_capture_go_to_cgraws_handle_on_the_capture_stream(env):
    backend, dll = env["backend"], env["dll"]
    originals = {n: getattr(backend, n) for n in ("sgemm", "gemmEx", "sgemv", "isamax", "setPointerMode")}
    r = _router(env)
    r.enter()
    mine = r.handle
    assert mine == 0xA000 and dll.named("cublasSetStream_v2")[-1] == (mine, CAPTURE)
    assert dll.named("cublasSgemm_v2")  # a new handle is warmed up with one GEMM before the capture
    cupy_handle = sys.modules["cupy"].cuda.device.get_cublas_handle()
    assert r.cupy_handle == cupy_handle
    assert backend.sgemm is not originals["sgemm"] and backend.gemmEx is not originals["gemmEx"]
    assert backend.sgemv is originals["sgemv"] and backend.isamax is originals["isamax"]  # other shape; not covered
    assert backend.sgemm.__name__ == "sgemm"

    n_warm = len(dll.named("cublasSgemm_v2"))
    backend.sgemm(*_sgemm_args(cupy_handle))
    backend.sgemm(*_sgemm_args(cupy_handle))
    calls = dll.named("cublasSgemm_v2")[n_warm:]
    assert calls == [_sgemm_args(mine)] * 2 and r.calls == 2 and not env["eager"]
    assert env["allocs"][-1] == 1 << 20 and len([a for a in env["allocs"] if a == 1 << 20]) == 1  # one workspace
    assert dll.named("cublasSetWorkspace_v2") == [(mine, 0x7000000 + 0x10000 * len(env["allocs"]), 1 << 20)]

    with pytest.raises(NotImplementedError, match="during stream capture"):
        backend.isamax(cupy_handle, 4, 0x1000, 1, 0x2000)  # not covered: CuPy's refusal, as before
    with pytest.raises(NotImplementedError):
        backend.sgemm(*_sgemm_args(0x999))  # a handle of the user's own: CuPy's path (its refusal)
    env["current"] = EAGER  # another stream (not capturing): CuPy's path, eagerly
    backend.sgemm(*_sgemm_args(cupy_handle))
    assert [e[0] for e in env["eager"]] == ["sgemm"]
    env["current"] = CAPTURE

    seen = []
    t = threading.Thread(target=lambda: seen.append(_eager_on_other_thread(backend)))
    t.start()
    t.join()
    assert seen == ["refused"]  # another thread's call is CuPy's: here its stream is the capturing one

    r.exit()
    assert all(getattr(backend, n) is f for n, f in originals.items())
    assert dll.named("cublasSetStream_v2")[-1] == (mine, 0) and B._idle == {0: [mine]}
    assert r._workspace is None

    r2 = _router(env)
    r2.enter()  # the idle handle again, no new one, no warm-up
    assert r2.handle == mine and len(dll.named("cublasCreate_v2")) == 1
    assert len(dll.named("cublasSgemm_v2")) == n_warm + 2
    r2.exit()


def _eager_on_other_thread(backend):
    try:
        backend.sgemm(*_sgemm_args(sys.modules["cupy"].cuda.device.get_cublas_handle()))
    except NotImplementedError:
        return "refused"
    return "ran"


def test_modes_are_mirrored_onto_both_handles_and_cupys_put_back(env):
    backend, dll = env["backend"], env["dll"]
    r = _router(env)
    r.enter()
    h = r.cupy_handle
    backend.setPointerMode(h, 1)  # DEVICE: cupy.cublas.dot with a CuPy out
    assert backend.getPointerMode(h) == 1 and dll.named("cublasSetPointerMode_v2")[-1] == (r.handle, 1)
    backend.sdot(h, 8, 0x1000, 1, 0x2000, 1, 0x3000)
    assert dll.named("cublasSdot_v2") == [(r.handle, 8, 0x1000, 1, 0x2000, 1, 0x3000)]
    backend.setPointerMode(h, 0)  # HOST: the result would be written to host memory
    with pytest.raises(CaptureError, match="host memory") as ei:
        backend.sdot(h, 8, 0x1000, 1, 0x2000, 1, 0x3000)
    assert ei.value.name == "CUBLAS_NOT_COVERED" and len(dll.named("cublasSdot_v2")) == 1
    backend.setMathMode(h, 3)
    backend.setPointerMode(h, 1)  # left changed by the block (an exception between set and reset)
    assert dll.named("cublasSetMathMode")[-1] == (r.handle, 3)
    r.exit(failed=True)
    assert env["modes"][h] == [0, 0]  # CuPy's handle as it was before the capture


def test_modes_of_cupys_handle_are_copied_at_enter(env):
    r = _router(env)
    h = sys.modules["cupy"].cuda.device.get_cublas_handle()
    env["modes"][h] = [1, 2]
    r.enter()
    assert (r.pointer_mode, r.math_mode) == (1, 2)
    assert env["dll"].named("cublasSetPointerMode_v2")[-1] == (r.handle, 1)
    assert env["dll"].named("cublasSetMathMode")[-1] == (r.handle, 2)
    r.exit()
    assert env["modes"][h] == [1, 2]


def test_gemm_ex_gets_a_migrated_compute_type(env):
    backend, dll = env["backend"], env["dll"]
    r = _router(env)
    r.enter()
    h = r.cupy_handle
    args = [h, 0, 0, 4, 4, 4, 0x10, 0x1000, 0, 4, 0x2000, 0, 4, 0x20, 0x3000, 0, 4, 0, 99]
    backend.gemmEx(*args)  # compute type CUDA_R_32F, as CuPy passes a cudaDataType
    backend.gemmEx(*args[:17], 77, 99)  # CUBLAS_COMPUTE_32F_FAST_TF32: unchanged
    backend.setMathMode(h, 2)
    backend.gemmEx(*args)  # pedantic math mode: the pedantic compute type
    assert [c[17] for c in dll.named("cublasGemmEx")] == [68, 77, 69]
    with pytest.raises(FakeCUBLASError):  # as cuBLAS's overload returns NOT_SUPPORTED, CuPy's error
        backend.gemmEx(*args[:17], 14, 99)
    r.exit()


def test_argument_ranges_and_counts(env):
    backend, dll = env["backend"], env["dll"]
    r = _router(env)
    r.enter()
    h = r.cupy_handle
    big = 1 << 33
    backend.sgemm(h, 0, 0, big, 4, 4, 0x10, 0x1000, big, 0x2000, 4, 0x20, 0x3000, big)
    assert dll.named("cublasSgemm_v2_64") == [(r.handle, 0, 0, big, 4, 4, 0x10, 0x1000, big, 0x2000, 4, 0x20,
                                              0x3000, big)]
    with pytest.raises(CaptureError, match="does not fit in a C int"):
        backend.sgetrfBatched(h, big, 0x1000, 4, 0x2000, 0x3000, 1)  # plain ints: ctypes would truncate
    with pytest.raises(CaptureError, match="15 arguments"):
        backend.sgemm(*_sgemm_args(h), 5)
    dll.status["cublasSgemm_v2"] = 13
    with pytest.raises(FakeCUBLASError, match="13"):
        backend.sgemm(*_sgemm_args(h))
    r.exit(failed=True)


def test_info_checks_refuse_under_linalg_raise_and_pass_through_otherwise(env):
    util = env["util"]
    check = util._check_cublas_info_array_if_synchronization_allowed
    routine = env["backend"].sgetrfBatched
    r = _router(env)
    r.enter()
    routed = util._check_cublas_info_array_if_synchronization_allowed
    assert routed is not check
    routed(routine, "info")  # linalg='ignore' (CuPy's default): CuPy's check, which returns at once
    env["linalg"] = "raise"

    # a CuPy function calling the check, as cupy.linalg._solve._batched_inv does
    ns = {"__name__": "cupy.linalg._solve", "util": util, "routine": routine}
    exec("def inv():\n    return util._check_cublas_info_array_if_synchronization_allowed(routine, 'info')\n", ns)
    with pytest.raises(CaptureError, match="linalg='ignore'") as ei:
        ns["inv"]()
    assert "cupy.linalg._solve.inv" in ei.value.description and "sgetrfBatched" in ei.value.description
    assert ei.value.name == "LINALG_CHECK_NOT_COVERED"
    util._check_cusolver_dev_info_if_synchronization_allowed("potrf", "info")  # cuSOLVER's: interop.cupy.solver's
    env["current"] = EAGER  # a call on another stream is not the capture's: CuPy's check
    routed(routine, "info")
    env["current"] = CAPTURE
    out = []
    t = threading.Thread(target=lambda: out.append(routed(routine, "info")))  # another thread: CuPy's
    t.start()
    t.join()
    assert env["checked"] == [("cublas", routine), ("cusolver", "potrf"), ("cublas", routine), ("cublas", routine)]
    r.exit()
    assert util._check_cublas_info_array_if_synchronization_allowed is check


def test_two_captures_on_two_threads_use_two_handles(env):
    backend, dll = env["backend"], env["dll"]
    ready, go, done = threading.Barrier(2), threading.Event(), []

    def capture_on_thread():
        r = _router(env)
        r.enter()
        ready.wait()
        go.wait()
        backend.sgemm(*_sgemm_args(r.cupy_handle))
        done.append(r.handle)
        r.exit()

    t = threading.Thread(target=capture_on_thread)
    t.start()
    r = _router(env)
    r.enter()
    ready.wait()
    assert len(B._routers) == 2 and r.handle != B._routers[t.ident].handle
    backend.sgemm(*_sgemm_args(r.cupy_handle))
    mine = r.handle
    r.exit()
    assert B._patches  # the other capture still routes
    go.set()
    t.join()
    handles = {args[0] for args in dll.named("cublasSgemm_v2")}
    assert handles == {mine, done[0]} and not B._patches
    assert sorted(B._idle[0]) == sorted(handles)


def test_a_failed_enter_leaves_nothing_replaced(env):
    env["dll"].status["cublasSetPointerMode_v2"] = 7
    r = _router(env)
    with pytest.raises(CaptureError, match="SetPointerMode"):
        r.enter()
    assert not B._patches and not B._routers and r.handle is None


def test_exit_after_a_failed_call_restores_everything(env):
    backend = env["backend"]
    original = backend.sgemm
    r = _router(env)
    r.enter()
    env["dll"].status["cublasSgemm_v2"] = 14
    with pytest.raises(FakeCUBLASError):
        backend.sgemm(*_sgemm_args(r.cupy_handle))
    mine = r.handle
    r.exit(failed=True)
    assert backend.sgemm is original and env["dll"].named("cublasSetStream_v2")[-1] == (mine, 0)


# ---------------------------------------------------------------- the capture's messages


def test_a_cublas_call_cgraw_refuses_gives_its_own_words():
    from cgraw import capture

    msg = capture(pool=None)._classify(B._not_covered("sdot", "it would write its result to host memory"), 0, 0)
    assert "cuBLAS sdot" in msg and "host memory" in msg and "outside the capture" in msg


def _raise_through(modules_and_files, exc):
    """Raise ``exc`` through a chain of functions, each defined in a fake module and file (outermost
    first), so the traceback looks like CuPy's (Cython frames carry their module's globals)."""
    def call_next(i):
        if i == len(modules_and_files):
            raise exc
        mod, file, fname = modules_and_files[i]
        src = f"def {fname}(i):\n    return call_next(i + 1)\n"
        ns = {"__name__": mod, "call_next": call_next}
        exec(compile(src, file, "exec"), ns)
        return ns[fname](i)

    try:
        call_next(0)
    except type(exc) as e:
        return e


def test_refused_library_calls_name_the_call():
    from cgraw.interop.cupy import pools as icupy

    chain = [("user", "user.py", "body"), ("cupy.linalg._solve", "cupy/linalg/_solve.py", "solve"),
             ("cupy_backends.cuda.libs.cusolver", "cupy_backends/cuda/libs/cusolver.pyx", "sgetrf"),
             ("cupy_backends.cuda.libs.cusolver", "cupy_backends/cuda/libs/cusolver.pyx", "setStream")]
    e = _raise_through(chain, NotImplementedError("calling cuSOLVER API during stream capture is currently "
                                                  "unsupported"))
    msg = icupy.CupyRouting.classify(e)
    assert msg.startswith(icupy.CUSOLVER) and msg.endswith("[cupy.linalg._solve.solve -> cusolver.sgetrf]")
    chain = [("cupy._core.core", "cupy/_core/core.pyx", "__matmul__"),
             ("cupy_backends.cuda.libs.cublas", "cupy_backends/cuda/libs/cublas.pyx", "isamax")]
    e = _raise_through(chain, NotImplementedError("calling cuBLAS API during stream capture is currently "
                                                  "unsupported"))
    assert icupy.CupyRouting.classify(e).endswith("[cupy._core.core.__matmul__ -> cublas.isamax]")
    assert icupy._library_call(ValueError("no traceback"), "cublas") == ""

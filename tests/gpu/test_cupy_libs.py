"""GPU tier of CuPy's cuBLAS calls inside ``cgraw.capture()``, routed to a cgraw-owned cuBLAS
handle (``cgraw/interop/cupy/blas.py``), also run with cuda-bindings 12.9.10 and under memcheck.
Every replay is compared with eager CuPy on new input values written in place. Then the cuSOLVER
calls (``cgraw/interop/cupy/solver.py``), the single-matrix svd/eigh family through the Jacobi routines
(JACOBI_OPS, the 33x33 refusals) among them."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

import cgraw
from cgraw.interop.cupy import blas as cupy_blas, solver as cupy_solver

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
cublas = pytest.importorskip("cupy_backends.cuda.libs.cublas")  # CuPy's wrappers (the ones cgraw replaces)
cpblas = pytest.importorskip("cupy.cublas")  # CuPy's BLAS functions on arrays

rng = np.random.default_rng()
TOL = {"float16": (2e-3, 2e-3), "float32": (1e-5, 1e-5), "float64": (1e-12, 1e-12), "complex64": (1e-5, 1e-5),
       "complex128": (1e-12, 1e-12)}
OPS = {  # name: (function of two arrays, their shapes)
    "matmul": (cp.matmul, ((16, 32), (32, 8))),
    "operator @": (lambda a, b: a @ b, ((16, 32), (32, 8))),
    "dot": (cp.dot, ((16, 32), (32,))),
    "inner": (cp.inner, ((16, 32), (8, 32))),
    "tensordot": (lambda a, b: cp.tensordot(a, b, axes=2), ((4, 8, 16), (8, 16, 5))),
    "einsum": (lambda a, b: cp.einsum("ij,jk->ik", a, b), ((16, 32), (32, 8))),
    "batched matmul": (cp.matmul, ((4, 16, 32), (4, 32, 8))),
    "broadcast batched matmul": (cp.matmul, ((4, 16, 32), (32, 8))),
    "norm of a product": (lambda a, b: cp.linalg.norm(a @ b), ((16, 32), (32, 8))),
    "norms": (lambda a, b: cp.linalg.norm(a) * cp.linalg.norm(b, "fro"), ((64,), (16, 16))),  # reductions
}


def rand(shape, dtype="float32"):
    dt = np.dtype(dtype)
    x = rng.standard_normal(shape)
    if dt.kind == "c":
        x = x + 1j * rng.standard_normal(shape)
    return cp.asarray(x.astype(dt))


def well_conditioned(*shape):
    n = shape[-1]
    return cp.asarray((rng.standard_normal(shape) + n * np.eye(n)).astype(np.float32))


def close(got, want, dtype="float32"):
    rtol, atol = TOL[np.dtype(dtype).name]
    scale = max(1.0, float(cp.abs(want).max()))
    cp.testing.assert_allclose(got, want, rtol=rtol, atol=atol * scale)


def refresh(*arrays):
    for x in arrays:
        x[...] = rand(x.shape, x.dtype)


def handle_stream(lib, handle) -> int:
    """cuBLAS's stream of ``handle`` (cublasGetStream_v2), read through cgraw's library."""
    fn = lib._dll.cublasGetStream_v2
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)], ctypes.c_int
    out = ctypes.c_void_p()
    assert fn(handle, ctypes.byref(out)) == 0
    return int(out.value or 0)


def cupy_handle_state():
    h = cp.cuda.device.get_cublas_handle()
    return h, (cublas.getStream(h), cublas.getPointerMode(h), cublas.getMathMode(h))


def assert_routing_ended(originals):
    assert not cupy_blas._routers and not cupy_blas._patches
    assert all(getattr(cublas, n) is f for n, f in originals.items())
    lib = cupy_blas.library()
    for handles in cupy_blas._idle.values():
        assert all(handle_stream(lib, h) == 0 for h in handles)  # no idle handle left on a capture stream


_solver_backend = pytest.importorskip("cupy_backends.cuda.libs.cusolver")
_solver_originals = {n: getattr(_solver_backend, n) for n in ("sgesvd", "zgesvd_bufferSize", "xsyevd")}


@pytest.fixture
def originals():
    return {n: getattr(cublas, n) for n in ("gemmEx", "gemmStridedBatchedEx", "sgemmBatched", "sdot",
                                            "setPointerMode", "setMathMode") if hasattr(cublas, n)}


# ---------------------------------------------------------------- captured products equal eager


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("op", list(OPS))
def test_products_capture_and_replay_equal_eager(pool, op, dtype, originals):
    f, shapes = OPS[op]
    a, b = (rand(s, dtype) for s in shapes)
    f(a, b)  # eager first: kernels, plans, CuPy's handle
    with cgraw.capture(pool=pool) as g:
        out = f(a, b)
    assert g.num_nodes >= 1 and pool.owns(int(out.data.ptr))
    assert_routing_ended(originals)
    previous = None
    for _ in range(3):
        a[...], b[...] = rand(a.shape, dtype), rand(b.shape, dtype)
        g.replay()
        close(out, f(a, b), dtype)
        assert previous is None or not cp.array_equal(out, previous)  # recomputed from the new values
        previous = out.copy()
    g.close()


@pytest.mark.parametrize("mode", ["thread_local", "global", "relaxed"])
def test_capture_modes(pool, mode):
    a, b = rand((64, 64)), rand((64, 64))
    with cgraw.capture(pool=pool, mode=mode) as g:
        y = cp.tanh(a @ b) @ a
    for _ in range(2):
        refresh(a, b)
        g.replay()
        close(y, cp.tanh(a @ b) @ a)
    g.close()


def gemv_into(a, x):
    y = cp.empty_like(x)  # gemv writes y = alpha op(a) x + beta y in place; beta = 0 does not read it
    cpblas.gemv("N", 0.5, a, x, 0.0, y)
    return y


def test_cupy_cublas_functions(pool):
    a, b, x, y = rand((16, 16)), rand((16, 16)), rand((16,)), rand((16,))
    sa, sb = well_conditioned(4, 8, 8), rand((4, 8))
    calls = {
        "gemm": lambda: cpblas.gemm("N", "T", a, b, alpha=0.5),
        "gemv": lambda: gemv_into(a, x),
        "geam": lambda: cpblas.geam("T", "N", 1.5, a, -0.5, b),
        "dot": lambda: cpblas.dot(x, y),  # the result on the device: pointer mode DEVICE
        "nrm2": lambda: cpblas.nrm2(x),
        "batched_gesv": lambda: cpblas.batched_gesv(sa, sb),
        "batched inv": lambda: cp.linalg.inv(sa),
    }
    for fn in calls.values():
        fn()
    with cgraw.capture(pool=pool) as g:
        outs = {k: fn() for k, fn in calls.items()}
    for _ in range(2):
        refresh(a, b, x, y, sb)
        sa[...] = well_conditioned(4, 8, 8)
        g.replay()
        for k, fn in calls.items():
            close(outs[k], fn())
    g.close()


def test_a_host_result_is_refused_by_name(pool, originals):
    x = rand((16,))
    h, before = cupy_handle_state()
    with pytest.raises(cgraw.CaptureError, match="host memory") as ei:
        with cgraw.capture(pool=pool):
            cpblas.dot(x, x, out=np.empty((), np.float32))  # pointer mode HOST: the result on the host
    assert "sdot" in str(ei.value)
    assert cupy_handle_state() == (h, before)
    assert_routing_ended(originals)


def test_cupys_handle_state_is_restored_and_eager_cupy_unaffected(pool, originals):
    a, x = rand((32, 32)), rand((32,))
    h, before = cupy_handle_state()
    with cgraw.capture(pool=pool) as g:
        y = a @ a
        d = cpblas.dot(x, x)  # sets DEVICE pointer mode on CuPy's handle and back
    assert cupy_handle_state() == (h, before)
    assert_routing_ended(originals)
    e = a @ a  # eager, on CuPy's own handle
    cp.testing.assert_allclose(e, cp.asarray(a.get() @ a.get()), rtol=1e-4, atol=1e-4)
    g.replay()
    close(y, e)
    close(d, cp.dot(x, x))
    g.close()


def test_many_captures_reuse_one_cgraw_handle(pool):
    a = rand((16, 16))
    a @ a
    dev = cp.cuda.Device().id
    with cgraw.capture(pool=pool) as g:
        a @ a
    g.close()
    idle = list(cupy_blas._idle.get(dev, ()))
    assert idle
    for _ in range(20):
        with cgraw.capture(pool=pool) as g:
            a @ a
        g.close()
    assert cupy_blas._idle.get(dev) == idle  # taken and given back, none made


def test_workspace_comes_from_the_graphs_pool(device, monkeypatch):
    monkeypatch.setenv("CGRAW_CUBLAS_WORKSPACE_BYTES", str(6 << 20))
    a = rand((64, 64))
    a @ a
    pool = cgraw.DevicePool(device, name="ws")
    with cgraw.capture(pool=pool) as g:
        y = a @ a
    st = pool.stats()
    assert st.peak_allocated_bytes >= 6 << 20 and st.live_blocks == 1  # the workspace is back, y lives
    g.replay()
    close(y, a @ a)
    g.close()
    del y
    pool.close()


# ---------------------------------------------------------------- failures and threads


@pytest.mark.parametrize("how", ["user exception", "host sync", "uncovered cuBLAS call"])
def test_a_failed_capture_restores_the_handles(pool, originals, how):
    a, x = rand((32, 32)), rand((32,))
    a @ a
    h, before = cupy_handle_state()
    snap = pool.snapshot()
    mine = ValueError("mine")
    expected = ValueError if how == "user exception" else cgraw.CaptureError
    with pytest.raises(expected) as ei:
        with cgraw.capture(pool=pool):
            y = a @ a
            cpblas.dot(x, x)
            if how == "user exception":
                raise mine
            if how == "host sync":
                y.get()
            cpblas.iamax(x)  # isamax: not routed, CuPy refuses it
    if how == "user exception":
        assert ei.value is mine
    elif how == "uncovered cuBLAS call":
        assert "cuBLAS" in str(ei.value) and "iamax" in str(ei.value)
    assert cupy_handle_state() == (h, before)
    assert_routing_ended(originals)
    assert pool.snapshot() == snap
    with cgraw.capture(pool=pool) as g:  # and the next capture works
        z = a @ a
    g.replay()
    close(z, a @ a)
    g.close()


def test_a_capture_on_another_thread_while_this_one_multiplies_eagerly(pool, originals):
    a, b = rand((64, 64)), rand((64, 64))
    c, d = rand((48, 48)), rand((48, 48))
    a @ b
    inside, proceed, box = threading.Event(), threading.Event(), {}

    def worker():
        try:
            with cgraw.capture(pool=pool) as g:
                y = cp.tanh(a @ b)
                inside.set()
                proceed.wait(30)
                y = y @ b
            box.update(g=g, y=y)
        except BaseException as e:  # reported below
            box["error"] = e
            inside.set()

    t = threading.Thread(target=worker)
    t.start()
    assert inside.wait(30)
    with cp.cuda.Stream(non_blocking=True) as s:  # eager on this thread, during the other's capture
        e = c @ d  # CuPy's own path: this thread has no capture
        s.synchronize()
    cp.testing.assert_allclose(e, cp.asarray(c.get() @ d.get()), rtol=1e-4, atol=1e-4)
    proceed.set()
    t.join(60)
    assert "error" not in box, box.get("error")
    assert_routing_ended(originals)
    for _ in range(2):
        refresh(a, b)
        box["g"].replay()
        close(box["y"], cp.tanh(a @ b) @ b)
    box["g"].close()


def test_graphed_cupy_mlp(fresh_trees):
    w1, w2 = rand((64, 128)), rand((128, 16))

    @cgraw.graphed
    def mlp(x):
        return cp.tanh(x @ w1) @ w2

    for _ in range(4):
        x = rand((8, 64))
        close(mlp(x), cp.tanh(x @ w1) @ w2)


# ---------------------------------------------------------------- linear algebra's checks


def test_an_info_check_that_would_synchronise_is_refused_by_name(pool):
    import cupyx

    a = well_conditioned(4, 8, 8)
    cp.linalg.inv(a)
    with cupyx.errstate(linalg="raise"):
        with pytest.raises(cgraw.CaptureError, match="linalg='ignore'") as ei:
            with cgraw.capture(pool=pool):
                cp.linalg.inv(a)
    assert "getrfBatched" in str(ei.value)
    with cgraw.capture(pool=pool) as g:  # CuPy's default (linalg='ignore'): captured
        inv = cp.linalg.inv(a)
    a[...] = well_conditioned(4, 8, 8)
    g.replay()
    close(inv, cp.linalg.inv(a))
    g.close()


def test_a_cusolver_call_cgraw_does_not_route_is_refused_naming_the_call(pool, monkeypatch):
    a, b = well_conditioned(16, 16), rand((16,))
    cp.linalg.solve(a, b)
    monkeypatch.setenv("CGRAW_CUPY_CUSOLVER", "0")  # not routed: CuPy's own refusal, named
    with pytest.raises(cgraw.CaptureError, match="cuSOLVER") as ei:
        with cgraw.capture(pool=pool):
            cp.linalg.solve(a, b)
    assert "solve" in str(ei.value) and "getrf" in str(ei.value)
    monkeypatch.delenv("CGRAW_CUPY_CUSOLVER")
    q = rand((4, 48, 40))  # batched qr: cupyx/_cusolver.pyx calls geqrf in C, which cgraw cannot route
    with pytest.raises(cgraw.CaptureError, match="cuSOLVER") as ei:
        with cgraw.capture(pool=pool):
            cp.linalg.qr(q)
    assert "qr" in str(ei.value)


# ---------------------------------------------------------------- cuSOLVER


def spd(n, dtype="float32", batch=()):
    x = rand((*batch, n, n), dtype)
    return x @ x.swapaxes(-1, -2).conj() + n * cp.eye(n, dtype=dtype)


def hermitian(n, dtype="float32", batch=()):
    x = rand((*batch, n, n), dtype)
    return x + x.swapaxes(-1, -2).conj()


def well(n, dtype="float32", batch=()):
    return rand((*batch, n, n), dtype) + n * cp.eye(n, dtype=dtype)


SOLVER_DTYPES = ["float32", "float64", "complex64", "complex128"]
SOLVER_OPS = {  # name: (function, input makers), each maker(dtype) -> array; routed, so captured
    "solve": (cp.linalg.solve, (lambda d: well(16, d), lambda d: rand((16, 3), d))),
    "solve [batched]": (cp.linalg.solve, (lambda d: well(8, d, (3,)), lambda d: rand((3, 8, 2), d))),
    "inv": (cp.linalg.inv, (lambda d: well(16, d),)),
    "cholesky": (cp.linalg.cholesky, (lambda d: spd(16, d),)),
    "cholesky [batched]": (cp.linalg.cholesky, (lambda d: spd(8, d, (4,)),)),
    "qr": (lambda a: cp.linalg.qr(a)[1], (lambda d: rand((24, 16), d),)),  # R: unique up to signs; see below
    "eigvalsh [batched]": (cp.linalg.eigvalsh, (lambda d: hermitian(8, d, (4,)),)),
    "eigvalsh [batch of one]": (cp.linalg.eigvalsh, (lambda d: hermitian(16, d, (1,)),)),  # the refusal's hint
    "svd [batched, small]": (lambda a: cp.linalg.svd(a, compute_uv=False), (lambda d: rand((4, 12, 10), d),)),
    "tensorsolve": (cp.linalg.tensorsolve, (lambda d: well(16, d).reshape(4, 4, 16), lambda d: rand((4, 4), d))),
    "tensorinv": (lambda a: cp.linalg.tensorinv(a, ind=2), (lambda d: well(16, d).reshape(4, 4, 4, 4),)),
}
# single-matrix gesvd/Xsyevd synchronise inside cuSOLVER (seen on the H200): up to 32x32 cgraw runs them as
# gesvdjBatched/syevjBatched with a batch of one.
# name -> (function, input makers, how the replay is checked: "svd"/"eigh" factorisation, or "close")
JACOBI_OPS = {
    "svd 16x16": (cp.linalg.svd, (lambda d: rand((16, 16), d),), "svd"),
    "svd 24x16 full": (cp.linalg.svd, (lambda d: rand((24, 16), d),), "svd"),
    "svd 24x16 reduced": (lambda a: cp.linalg.svd(a, full_matrices=False), (lambda d: rand((24, 16), d),), "svd"),
    "svd 12x20 full": (cp.linalg.svd, (lambda d: rand((12, 20), d),), "svd"),
    "svd 12x20 reduced": (lambda a: cp.linalg.svd(a, full_matrices=False), (lambda d: rand((12, 20), d),), "svd"),
    "svd 32x32": (cp.linalg.svd, (lambda d: rand((32, 32), d),), "svd"),
    "svd values": (lambda a: cp.linalg.svd(a, compute_uv=False), (lambda d: rand((24, 16), d),), "close"),
    "svd values 12x20": (lambda a: cp.linalg.svd(a, compute_uv=False), (lambda d: rand((12, 20), d),), "close"),
    "eigh L": (cp.linalg.eigh, (lambda d: hermitian(16, d),), "eigh"),
    "eigh U": (lambda a: cp.linalg.eigh(a, UPLO="U"), (lambda d: hermitian(16, d),), "eigh"),
    "eigvalsh L": (cp.linalg.eigvalsh, (lambda d: hermitian(16, d),), "close"),
    "eigvalsh U": (lambda a: cp.linalg.eigvalsh(a, UPLO="U"), (lambda d: hermitian(32, d),), "close"),
    # m <= n: with m > n CuPy tests rank != n on the host (test_tall_lstsq_and_cond_stop_at_a_host_read)
    "lstsq": (lambda a, b: cp.linalg.lstsq(a, b, rcond=None)[0], (lambda d: rand((8, 24), d),
                                                                  lambda d: rand((8,), d)), "close"),
    "pinv": (cp.linalg.pinv, (lambda d: rand((16, 8), d),), "close"),
    "matrix_rank": (cp.linalg.matrix_rank, (lambda d: rand((16, 16), d),), "close"),
    "norm ord=2": (lambda a: cp.linalg.norm(a, 2), (lambda d: rand((16, 16), d),), "close"),
}
# over 32x32: refused by name before cuSOLVER runs; name -> (function, input maker, routine named)
REFUSED_OPS = {
    "svd 33x33": (cp.linalg.svd, lambda d: rand((33, 33), d), "gesvd"),
    "svd values 40x8": (lambda a: cp.linalg.svd(a, compute_uv=False), lambda d: rand((40, 8), d), "gesvd"),
    "eigh 33x33": (cp.linalg.eigh, lambda d: hermitian(33, d), "xsyevd"),
    "eigvalsh 33x33": (cp.linalg.eigvalsh, lambda d: hermitian(33, d), "xsyevd"),
}


def _solver_input(maker, dtype):
    return maker(dtype)


@pytest.mark.parametrize("dtype", SOLVER_DTYPES)
@pytest.mark.parametrize("op", list(SOLVER_OPS))
def test_linalg_captures_and_replays_equal_eager(pool, op, dtype, originals):
    f, makers = SOLVER_OPS[op]
    if dtype.startswith("complex") and op == "matrix_rank":
        pytest.skip("real inputs suffice for a rank")
    args = [_solver_input(m, dtype) for m in makers]
    f(*args)  # eager first: kernels, CuPy's handles
    with cgraw.capture(pool=pool) as g:
        out = f(*args)
    assert g.num_nodes >= 1
    assert not cupy_solver._routers and not cupy_solver._patches
    tol = "float32" if dtype in ("float32", "complex64") else "float64"
    for _ in range(3):
        for x, m in zip(args, makers, strict=True):
            x[...] = _solver_input(m, dtype)  # new values, written in place
        g.replay()
        want = f(*args)
        if op == "qr":  # R's rows are defined up to a phase
            out_, want = cp.abs(out), cp.abs(want)
        else:
            out_ = out
        rtol, atol = {"float32": (2e-4, 2e-4), "float64": (1e-9, 1e-9)}[tol]
        scale = max(1.0, float(cp.abs(want).max()))
        cp.testing.assert_allclose(out_, want, rtol=rtol, atol=atol * scale)
    g.close()


def _tol(dtype):
    return 1e-4 if np.dtype(dtype).name in ("float32", "complex64") else 1e-10


def check_svd(a, out, want, dtype):
    """A captured svd against the eager one (``want``): singular values close; U and VT of eager's shapes,
    orthonormal, and U diag(S) VT = a (their signs/phases are the Jacobi routine's, not gesvd's)."""
    u, s, vt = out
    wu, ws, wvt = want
    assert (u.shape, s.shape, vt.shape) == (wu.shape, ws.shape, wvt.shape)
    assert (u.dtype, s.dtype, vt.dtype) == (wu.dtype, ws.dtype, wvt.dtype)
    tol, k = _tol(dtype), s.shape[-1]
    scale = max(1.0, float(cp.abs(a).max())) * max(a.shape)
    cp.testing.assert_allclose(s, ws, rtol=tol, atol=tol * scale)
    eye = cp.eye
    assert float(cp.abs(u.conj().T @ u - eye(u.shape[1])).max()) <= tol * 10
    assert float(cp.abs(vt @ vt.conj().T - eye(vt.shape[0])).max()) <= tol * 10
    assert float(cp.abs((u[:, :k] * s) @ vt[:k] - a).max()) <= tol * scale


def check_eigh(a, out, want, dtype, uplo="L"):
    w, v = out
    ww, wv = want
    assert (w.shape, v.shape, w.dtype, v.dtype) == (ww.shape, wv.shape, ww.dtype, wv.dtype)
    tol = _tol(dtype)
    scale = max(1.0, float(cp.abs(a).max())) * a.shape[0]
    cp.testing.assert_allclose(w, ww, rtol=tol, atol=tol * scale)
    assert float(cp.abs(v.conj().T @ v - cp.eye(v.shape[0])).max()) <= tol * 10
    assert float(cp.abs(a @ v - v * w).max()) <= tol * scale


@pytest.mark.parametrize("dtype", SOLVER_DTYPES)
@pytest.mark.parametrize("op", list(JACOBI_OPS))
def test_single_matrix_svd_and_eigh_capture_through_the_jacobi_routines(pool, op, dtype, originals):
    """gesvd/Xsyevd up to 32x32 run as gesvdjBatched/syevjBatched (batch of one) in the capture; each replay
    on new values is checked against eager CuPy (gesvd/syevd): values close, vectors up to sign/phase."""
    f, makers, how = JACOBI_OPS[op]
    args = [m(dtype) for m in makers]
    f(*args)  # eager first: kernels, CuPy's handles
    with cgraw.capture(pool=pool) as g:
        out = f(*args)
    assert g.num_nodes >= 1
    assert not cupy_solver._routers and not cupy_solver._patches
    assert all(getattr(_solver_backend, n) is fn for n, fn in _solver_originals.items())
    previous = None
    for _ in range(3):
        for x, m in zip(args, makers, strict=True):
            x[...] = m(dtype)  # new values, written in place
        g.replay()
        cp.cuda.get_current_stream().synchronize()
        want = f(*args)
        if how == "svd":
            check_svd(args[0], out, want, dtype)
        elif how == "eigh":
            check_eigh(args[0], out, want, dtype)
        else:
            rtol, atol = (2e-4, 2e-4) if _tol(dtype) > 1e-6 else (1e-9, 1e-9)
            scale = max(1.0, float(cp.abs(want).max()))
            cp.testing.assert_allclose(out, want, rtol=rtol, atol=atol * scale)
        first = out[0] if isinstance(out, tuple) else out
        assert previous is None or op == "matrix_rank" or not cp.array_equal(first, previous)  # recomputed
        previous = first.copy()
    g.close()


@pytest.mark.parametrize("dtype", ["float32", "complex128"])
@pytest.mark.parametrize("op", list(REFUSED_OPS))
def test_over_32x32_is_refused_by_name_and_leaves_cusolver_working(pool, op, dtype):
    """Larger than the Jacobi routines take: refused before cuSOLVER runs (gesvd/syevd in a capture broke the
    thread's next cuSOLVER call on the H200), so the eager calls right after work, in CuPy and in torch."""
    f, maker, routine = REFUSED_OPS[op]
    a = maker(dtype)
    want = f(a)
    with pytest.raises(cgraw.CaptureError, match=routine) as ei:
        with cgraw.capture(pool=pool):
            f(a)
    assert "up to 32x32 is routed through the Jacobi routine; larger: do it outside the capture" in str(ei.value)
    assert not cupy_solver._routers and not cupy_solver._patches
    got = f(a)  # eager CuPy, same inputs: gesvd/syevd as before, no stale error
    if isinstance(want, tuple) and len(want) == 3:
        check_svd(a, got, want, dtype)
    elif isinstance(want, tuple):
        check_eigh(a, got, want, dtype)
    else:
        close(got, want, "float32" if dtype == "float32" else "float64")
    torch = pytest.importorskip("torch")
    t = torch.randn(24, 16, device="cuda", dtype=torch.float64)
    q, r = torch.linalg.qr(t)  # torch's cuSOLVER (geqrf) right after
    torch.testing.assert_close(q @ r, t)


def test_tall_lstsq_and_cond_stop_at_a_host_read(pool):
    """Past the Jacobi svd CuPy reads a value on the host: lstsq with m > n (``rank != n``, for the
    residuals) and cond (``isnan(r).any()``): clear host-synchronisation errors."""
    a, b, w = rand((24, 8), "float64"), rand((24,), "float64"), well(16, "float64")
    for fn in (lambda: cp.linalg.lstsq(a, b, rcond=None), lambda: cp.linalg.cond(w)):
        fn()
        with pytest.raises(cgraw.CaptureError, match="host synchronisation"):
            with cgraw.capture(pool=pool):
                fn()
    cp.testing.assert_allclose(cp.linalg.lstsq(a, b, rcond=None)[0],
                               cp.asarray(np.linalg.lstsq(a.get(), b.get(), rcond=None)[0]), rtol=1e-9, atol=1e-9)


def test_savgol_filter_captures_through_gesvdj(pool):
    """Its coefficients are lstsq of a (polyorder + 1) x window system (m <= n: gesvdjBatched, then a
    scalar through a mask). The default mode="interp" fits the edges with polyfit, a tall lstsq whose
    rank CuPy compares on the host: a named host synchronisation; the
    other modes convolve and capture."""
    import cupyx.scipy.signal as _signal

    x = rand((256,), "float64")
    _signal.savgol_filter(x, 11, 3, mode="mirror")
    with cgraw.capture(pool=pool) as g:
        y = _signal.savgol_filter(x, 11, 3, mode="mirror")
    for _ in range(2):
        x[...] = rand((256,), "float64")
        g.replay()
        cp.testing.assert_allclose(y, _signal.savgol_filter(x, 11, 3, mode="mirror"), rtol=1e-9, atol=1e-9)
    g.close()
    with pytest.raises(cgraw.CaptureError, match="host synchronisation"):
        with cgraw.capture(pool=pool):
            _signal.savgol_filter(x, 11, 3)


def test_jacobi_substitution_params_are_made_once_per_handle(pool):
    a, b = rand((16, 16)), hermitian(8)
    cp.linalg.svd(a)
    cp.linalg.eigh(b)
    for _ in range(3):
        with cgraw.capture(pool=pool) as g:
            cp.linalg.svd(a)
            cp.linalg.eigh(b)
        g.close()
    handles = {h for h, _ in cupy_solver._jacobi_params}
    assert len(handles) <= sum(len(v) for v in cupy_solver._idle.values())
    assert len(cupy_solver._jacobi_params) == 2 * len(handles)


def test_the_linalg_raise_check_is_refused_naming_cusolver(pool):
    import cupyx

    a, b = well(16), rand((16,))
    cp.linalg.solve(a, b)
    with cupyx.errstate(linalg="raise"):
        with pytest.raises(cgraw.CaptureError, match="cuSOLVER") as ei:
            with cgraw.capture(pool=pool):
                cp.linalg.solve(a, b)
    assert "getrf" in str(ei.value) and "linalg='ignore'" in str(ei.value)


def test_jacobi_on_one_matrix_is_refused_by_name(pool):
    import cupyx.cusolver

    a = hermitian(8)
    cupyx.cusolver.syevj(a)
    with pytest.raises(cgraw.CaptureError, match="syevj") as ei:
        with cgraw.capture(pool=pool):
            cupyx.cusolver.syevj(a)
    assert "sweeps" in str(ei.value)


@pytest.mark.parametrize("how", ["user exception", "refused routine"])
def test_a_failed_solver_capture_restores_the_handles(pool, how):
    import cupyx.cusolver

    cusolver = pytest.importorskip("cupy_backends.cuda.libs.cusolver")
    originals = {n: getattr(cusolver, n) for n in ("sgetrf", "spotrf", "ssyevj", "xsyevd")}
    h = cp.cuda.device.get_cusolver_handle()
    stream_before = cusolver.getStream(h)
    a = well(8)
    with pytest.raises((cgraw.CaptureError, ValueError)):
        with cgraw.capture(pool=pool):
            cp.linalg.inv(a)
            if how == "user exception":
                raise ValueError("boom")
            cupyx.cusolver.syevj(hermitian(8))
    assert all(getattr(cusolver, n) is f for n, f in originals.items())
    assert not cupy_solver._routers and not cupy_solver._patches
    assert cusolver.getStream(h) == stream_before  # CuPy's handle untouched
    getstream = cupy_solver.library()._dll.cusolverDnGetStream
    getstream.argtypes, getstream.restype = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)], ctypes.c_int
    for handles in cupy_solver._idle.values():
        for mine in handles:
            out = ctypes.c_void_p()
            assert getstream(mine, ctypes.byref(out)) == 0 and not out.value  # unbound
    close(cp.linalg.inv(a) @ a, cp.eye(8, dtype=cp.float32))  # eager CuPy unaffected


def test_many_solver_captures_reuse_one_cgraw_handle(pool):
    a = spd(8)
    cp.linalg.cholesky(a)
    for _ in range(3):
        with cgraw.capture(pool=pool) as g:
            cp.linalg.cholesky(a)
        g.close()
    assert sum(len(v) for v in cupy_solver._idle.values()) == 1


# ---------------------------------------------------------------- the table against the installed CuPy


def test_the_table_and_constants_match_the_installed_cupy():
    from cupy_backends.cuda.api import runtime

    wrong = []
    for name, kinds in cupy_blas.SPECS.items():
        code = getattr(getattr(cublas, name, None), "__code__", None)
        if code is not None and code.co_argcount != len(kinds) + 1:
            wrong.append(f"{name}: CuPy {code.co_argcount}, cgraw {len(kinds) + 1}")
    assert not wrong, wrong  # a mismatch is left to CuPy (its refusal), never called with the wrong shape
    for name, value in (("CUBLAS_COMPUTE_16F", 64), ("CUBLAS_COMPUTE_32F", 68), ("CUBLAS_COMPUTE_64F", 70),
                        ("CUBLAS_COMPUTE_32I", 72), ("CUBLAS_POINTER_MODE_HOST", 0), ("CUBLAS_PEDANTIC_MATH", 2)):
        if hasattr(cublas, name):
            assert getattr(cublas, name) == value, name
    for name, value in (("CUDA_R_32F", 0), ("CUDA_R_64F", 1), ("CUDA_R_16F", 2), ("CUDA_C_32F", 4),
                        ("CUDA_C_64F", 5), ("CUDA_R_32I", 10)):
        if hasattr(runtime, name):
            assert getattr(runtime, name) == value, name
    lib = cupy_blas.library()
    assert lib is not None, "no libcublas found"
    print(f"cgraw calls cuBLAS from {lib.path}")


# ---------------------------------------------------------------- host uploads staged through the graph's pinned blocks
# (interop.cupy.staging: CuPy 14.2 refuses every host-to-device copy on a capturing stream, so cgraw
# wraps cupy._core.array and copies from the graph's pinned block itself; more cases in test_cupy_uploads.py)


def _staged_spans(g):
    from cgraw.interop.cupy.staging import StagedUploads

    holders = [h for h in g._keepalive if isinstance(h, StagedUploads)]
    return [p for h in holders for p in h.ptrs]


def test_asarray_of_a_numpy_array_replays_the_recorded_values(pool):
    host = rng.standard_normal(1000).astype(np.float32)
    recorded = host.copy()
    with cgraw.capture(pool=pool) as g:
        y = cp.asarray(host) * 2
    host[:] = -1  # a later change of the NumPy array does not reach the graph
    for _ in range(3):
        y[...] = 0
        g.replay()
        cp.cuda.runtime.deviceSynchronize()
        cp.testing.assert_array_equal(y, cp.asarray(recorded) * 2)
    assert len(_staged_spans(g)) == 1
    g.close()


def _gaussian(x):
    from cupyx.scipy import ndimage

    return ndimage.gaussian_filter(x, sigma=1.5)


def _zoom(x):
    from cupyx.scipy import ndimage

    return ndimage.zoom(x, 1.5, order=1)


def _stft(x):
    from cupyx.scipy import signal

    return signal.stft(x.ravel(), nperseg=64)[2]


@pytest.mark.parametrize("fn", [_gaussian, _zoom, _stft], ids=["gaussian_filter", "zoom", "stft"])
def test_library_uploads_capture_and_replay_equal_eager(pool, fn):
    x = rand((32, 32))
    fn(x)  # warm-up: kernels compiled, plans made
    with cgraw.capture(pool=pool) as g:
        y = fn(x)
    assert _staged_spans(g), "the function uploaded nothing: this test no longer covers staging"
    for _ in range(3):
        refresh(x)
        g.replay()
        cp.testing.assert_allclose(y, fn(x), rtol=1e-5, atol=1e-5 * max(1.0, float(cp.abs(fn(x)).max())))
    g.close()


def test_two_graphs_staged_blocks_never_overlap(pool):
    a, b = (rng.standard_normal(300).astype(np.float32) for _ in range(2))
    with cgraw.capture(pool=pool) as g1:
        y1 = cp.asarray(a) + 0
    with cgraw.capture(pool=pool) as g2:
        y2 = cp.asarray(b) + 0
    s1, s2 = _staged_spans(g1), _staged_spans(g2)
    assert s1 and s2
    assert all(abs(p - q) >= 1024 for p in s1 for q in s2)  # 300 float32 = 1200 bytes, 1536-byte blocks
    g2.replay()
    g1.replay()
    cp.testing.assert_array_equal(y1, cp.asarray(a))
    cp.testing.assert_array_equal(y2, cp.asarray(b))
    g1.close()
    g2.close()


def test_a_closed_graphs_blocks_are_reused(pool):
    from cgraw.interop.cupy import staging as cupy_staging

    host = np.arange(256, dtype=np.float32)
    arena = cupy_staging.arena()
    with cgraw.capture(pool=pool) as g1:
        cp.asarray(host) + 1
    held = arena.stats().allocated_bytes
    first = _staged_spans(g1)
    g1.close()
    assert arena.quarantined() >= 1 and arena.stats().allocated_bytes == held  # not reusable yet
    with cgraw.capture(pool=pool) as g2:  # the drain before this capture synchronises and reuses
        y = cp.asarray(host) + 1
    assert arena.quarantined() == 0 and arena.stats().allocated_bytes == held  # g1's block back, g2's taken
    assert len(_staged_spans(g2)) == len(first)
    g2.replay()
    cp.testing.assert_array_equal(y, cp.asarray(host) + 1)
    g2.close()


def test_an_upload_the_arena_cannot_hold_is_refused_by_name(pool, monkeypatch):
    from cgraw.interop.cupy import staging as cupy_staging

    monkeypatch.setattr(cupy_staging, "_arena", cupy_staging.PinnedArena(4096))
    with pytest.raises(cgraw.CaptureError, match="CGRAW_PINNED_STAGING_BYTES") as ei:
        with cgraw.capture(pool=pool):
            cp.asarray(np.ones(10_000, dtype=np.float32))
    assert "cupy._creation.from_data.asarray" in str(ei.value)
    with cgraw.capture(pool=pool) as g:  # the next capture works, eager CuPy too
        y = cp.asarray(np.ones(8, dtype=np.float32)) * 3
    g.replay()
    cp.testing.assert_array_equal(y, cp.full(8, 3, dtype=cp.float32))
    cp.testing.assert_array_equal(cp.asarray(np.ones(10_000, dtype=np.float32)).sum(), 10_000)
    g.close()


def test_a_capture_on_another_thread_while_this_thread_uploads_eagerly(pool):
    host = rng.standard_normal(512).astype(np.float32)
    inside, proceed, box = threading.Event(), threading.Event(), {}

    def worker():
        try:
            with cgraw.capture(pool=pool) as g:
                y = cp.asarray(host) * 2
                inside.set()
                proceed.wait(30)
                y = y + cp.asarray(host)
            box.update(g=g, y=y)
        except BaseException as e:  # reported below
            box["error"] = e
            inside.set()

    t = threading.Thread(target=worker)
    t.start()
    assert inside.wait(30)
    eager = [rng.standard_normal(4096).astype(np.float32) for _ in range(8)]
    with cp.cuda.Stream(non_blocking=True) as s:  # CuPy's own pinned pool: this thread has no capture
        got = [cp.asarray(e) for e in eager]
        s.synchronize()
    for e, d in zip(eager, got):
        cp.testing.assert_array_equal(d, cp.asarray(e))
    proceed.set()
    t.join(60)
    assert "error" not in box, box.get("error")
    box["g"].replay()
    cp.testing.assert_allclose(box["y"], cp.asarray(host) * 3, rtol=1e-6)
    box["g"].close()

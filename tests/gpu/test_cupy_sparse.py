"""GPU tier of CuPy's cuSPARSE calls inside ``cgraw.capture()``, routed to a
cgraw-owned cuSPARSE handle (``cgraw/interop/cupy/sparse.py``); tocsc is refused (it breaks the
context on the H200). Every replay is compared with eager CuPy after new values are written in place into the
sparse matrix's data and the dense operand (the sparsity structure stays fixed)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import cgraw
from cgraw.interop.cupy import sparse as cupy_sparse

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
sparse = pytest.importorskip("cupyx.scipy.sparse")
cusparse = pytest.importorskip("cupy_backends.cuda.libs.cusparse")  # CuPy's wrappers (the ones cgraw replaces)
cpx_cusparse = pytest.importorskip("cupyx.cusparse")  # CuPy's functions on sparse matrices

rng = np.random.default_rng()
SHAPE = (64, 48)
_MASK = np.random.default_rng(17).random(SHAPE) < 0.15
INDICES = np.nonzero(_MASK)[1].astype(np.int32)
INDPTR = np.concatenate([[0], np.cumsum(_MASK.sum(axis=1))]).astype(np.int32)
DTYPES = ["float32", "float64", "complex64", "complex128"]
TOL = {"float32": (1e-5, 1e-5), "float64": (1e-12, 1e-12), "complex64": (1e-5, 1e-5), "complex128": (1e-12, 1e-12)}


def rand(shape, dtype):
    x = rng.standard_normal(shape)
    if np.dtype(dtype).kind == "c":
        x = x + 1j * rng.standard_normal(shape)
    return cp.asarray(x.astype(dtype))


def make(fmt, dtype):
    """A CSR matrix of the fixed structure with random values, or its CSC form (made eagerly)."""
    m = sparse.csr_matrix((rand(INDICES.size, dtype), cp.asarray(INDICES), cp.asarray(INDPTR)), shape=SHAPE)
    return m if fmt == "csr" else m.tocsc()


def close(got, want, dtype):
    rtol, atol = TOL[np.dtype(dtype).name]
    scale = max(1.0, float(cp.abs(want).max()))
    cp.testing.assert_allclose(got, want, rtol=rtol, atol=atol * scale)


def assert_routing_ended(originals=None):
    assert not cupy_sparse._routers and not cupy_sparse._patches
    for name, fn in (originals or {}).items():
        assert getattr(cusparse, name) is fn, name
    getstream = cupy_sparse.library()._dll.cusparseGetStream
    getstream.argtypes, getstream.restype = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)], ctypes.c_int
    for handles in cupy_sparse._idle.values():
        for mine in handles:
            out = ctypes.c_void_p()
            assert getstream(mine, ctypes.byref(out)) == 0 and not out.value  # unbound


@pytest.fixture
def originals():
    return {n: getattr(cusparse, n) for n in ("spMV", "spMV_bufferSize", "spMM", "xcsr2coo", "sparseToDense",
                                               "scsrgeam2_bufferSizeExt", "setPointerMode")}


OPS = {  # name: (function of the matrix and the dense operand, matrix format, dense operand's shape or None)
    "csr @ vector": (lambda m, x: m @ x, "csr", (SHAPE[1],)),
    "csr.dot(vector)": (lambda m, x: m.dot(x), "csr", (SHAPE[1],)),
    "csr @ dense matrix": (lambda m, x: m @ x, "csr", (SHAPE[1], 8)),
    "csc @ vector": (lambda m, x: m @ x, "csc", (SHAPE[1],)),
    "csc @ dense matrix": (lambda m, x: m @ x, "csc", (SHAPE[1], 8)),
    "csr.sum(axis=1)": (lambda m, x: m.sum(axis=1), "csr", None),
    "sparseToDense": (lambda m, x: cpx_cusparse.sparseToDense(m), "csr", None),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(OPS))
def test_sparse_calls_capture_and_replay_equal_eager(pool, op, dtype, originals):
    f, fmt, xshape = OPS[op]
    m = make(fmt, dtype)
    x = None if xshape is None else rand(xshape, dtype)
    f(m, x)  # eager first: CuPy's canonical-format flags, check_availability, its cuSPARSE handle
    h = cp.cuda.device.get_cusparse_handle()
    stream_before = cusparse.getStream(h)
    with cgraw.capture(pool=pool) as g:
        out = f(m, x)
    assert g.num_nodes >= 1
    assert_routing_ended(originals)
    assert cusparse.getStream(h) == stream_before  # CuPy's handle untouched
    assert sum(len(v) for v in cupy_sparse._idle.values()) >= 1  # cgraw's handle was used and put back
    previous = None
    for _ in range(3):
        m.data[...] = rand(m.data.shape, dtype)  # new values, same structure, written in place
        if x is not None:
            x[...] = rand(x.shape, dtype)
        g.replay()
        close(out, f(m, x), dtype)
        assert previous is None or not cp.array_equal(out, previous)  # recomputed from the new values
        previous = out.copy()
    g.close()


def test_csr_to_coo_rows_are_recomputed_on_replay(pool):
    m = make("csr", "float32")
    want = m.tocoo().row.copy()
    with cgraw.capture(pool=pool) as g:
        coo = m.tocoo()  # xcsr2coo
    for _ in range(3):
        coo.row.fill(-1)
        g.replay()
        assert cp.array_equal(coo.row, want)
    g.close()


def test_tocsc_is_refused_before_cusparse_runs_and_the_context_stays_usable(pool, originals):
    """csr2cscEx2 returned INTERNAL_ERROR inside a capture on the H200 and left an illegal-address error
    behind: refused by name; the hint's way (convert outside, new values into .data) captures."""
    m = make("csr", "float64")
    want = m.tocsc()
    with pytest.raises(cgraw.CaptureError, match="csr2cscEx2") as ei:
        with cgraw.capture(pool=pool):
            m.tocsc()
    assert "outside the capture" in str(ei.value)
    assert_routing_ended(originals)
    cp.cuda.Device().synchronize()  # no sticky error
    again = m.tocsc()
    assert cp.array_equal(again.indptr, want.indptr) and cp.array_equal(again.data, want.data)
    c, x = m.tocsc(), rand((SHAPE[1],), "float64")
    c @ x  # eager first: CuPy reads the new matrix's canonical-format flag on the host once
    with cgraw.capture(pool=pool) as g:
        c.data[...] = c.data * 2.0  # new values into the converted matrix's data, inside the capture
        out = c @ x
    for _ in range(3):
        c.data[...] = rand(c.data.shape, "float64")
        x[...] = rand(x.shape, "float64")
        before = c.data.copy()
        g.replay()
        close(out, sparse.csc_matrix((before * 2.0, c.indices, c.indptr), shape=SHAPE) @ x, "float64")
    g.close()


def test_toarray_stops_at_a_host_read_after_csr2coo_is_routed(pool, originals):
    """csr_matrix.toarray converts through COO, whose sum_duplicates tests ``diff[1:].all()`` on the host:
    refused as a host synchronisation (not as cuSPARSE: xcsr2coo before it is routed)."""
    m = make("csr", "float32")
    want = m.toarray()
    with pytest.raises(cgraw.CaptureError) as ei:
        with cgraw.capture(pool=pool):
            m.toarray()
    assert "host synchronisation" in str(ei.value) and "cusparse" not in str(ei.value).lower()
    assert_routing_ended(originals)
    close(m.toarray(), want, "float32")


def test_csr_sum_over_rows_stops_at_a_host_read(pool, originals):
    """``csr.sum(axis=0)`` multiplies ``self.T`` (a new CSC each call) whose canonical-format flag CuPy
    reads on the host: a clear host-synchronisation error, eager CuPy unharmed."""
    m = make("csr", "float32")
    want = m.sum(axis=0)
    with pytest.raises(cgraw.CaptureError, match="host synchronisation"):
        with cgraw.capture(pool=pool):
            m.sum(axis=0)
    assert_routing_ended(originals)
    close(m.sum(axis=0), want, "float32")


def test_sparse_plus_sparse_is_refused_naming_csrgeam2_and_cupy_stays_usable(pool, originals):
    a, b = make("csr", "float32"), make("csr", "float32")
    x = rand((SHAPE[1],), "float32")
    want = (a + b).toarray()
    with pytest.raises(cgraw.CaptureError, match="csrgeam2") as ei:
        with cgraw.capture(pool=pool):
            a + b
    assert "cuSPARSE" in str(ei.value) and "host" in str(ei.value) and ".data" in str(ei.value)
    assert_routing_ended(originals)
    close((a + b).toarray(), want, "float32")  # eager CuPy: same result
    close(a @ x, a.toarray() @ x, "float32")  # and its cuSPARSE products still work eagerly


def test_a_failed_capture_restores_the_handles(pool, originals):
    m, x = make("csr", "float32"), rand((SHAPE[1],), "float32")
    m @ x
    h = cp.cuda.device.get_cusparse_handle()
    stream_before = cusparse.getStream(h)
    with pytest.raises(ValueError):
        with cgraw.capture(pool=pool):
            m @ x
            raise ValueError("boom")
    assert_routing_ended(originals)
    assert cusparse.getStream(h) == stream_before
    close(m @ x, m.toarray() @ x, "float32")


def test_many_captures_reuse_one_cgraw_handle(pool):
    m, x = make("csr", "float32"), rand((SHAPE[1],), "float32")
    m @ x
    for _ in range(3):
        with cgraw.capture(pool=pool) as g:
            m @ x
        g.close()
    assert sum(len(v) for v in cupy_sparse._idle.values()) == 1


def test_turned_off_cupy_refuses_as_before(pool, monkeypatch):
    m, x = make("csr", "float32"), rand((SHAPE[1],), "float32")
    m @ x
    monkeypatch.setenv("CGRAW_CUPY_CUSPARSE", "0")
    with pytest.raises(cgraw.CaptureError, match="cuSPARSE"):
        with cgraw.capture(pool=pool):
            m @ x
    assert not cupy_sparse._routers and not cupy_sparse._patches


def test_the_table_matches_the_installed_cupy():
    wrong = []
    for name, kinds in cupy_sparse.SPECS.items():
        code = getattr(getattr(cusparse, name, None), "__code__", None)
        if code is not None and code.co_argcount != cupy_sparse.cupy_arity(kinds):
            wrong.append(f"{name}: CuPy {code.co_argcount}, cgraw {cupy_sparse.cupy_arity(kinds)}")
    assert not wrong, wrong  # a mismatch is left to CuPy (its refusal), never called with the wrong shape
    assert all(hasattr(cusparse, n) for n in ("spMV", "spMM", "xcsr2coo", "sparseToDense", "csr2cscEx2"))
    if hasattr(cusparse, "CUSPARSE_POINTER_MODE_HOST"):
        assert cusparse.CUSPARSE_POINTER_MODE_HOST == cupy_sparse.POINTER_MODE_HOST
    lib = cupy_sparse.library()
    assert lib is not None, "no libcusparse found"
    print(f"cgraw calls cuSPARSE from {lib.path}")

"""CuPy's cuSPARSE calls inside captures, on a cgraw-owned handle.
The GPU tier runs it on the H200 (``tests/gpu/test_cupy_sparse.py``); REFUSED names what it showed unsafe.

Layer L7: CuPy is reached through ``sys.modules``, cuSPARSE through ``ctypes``; the shared machinery
is ``interop.cupy.route``, and this module follows ``interop.cupy.solver`` (same handle pool, thread and stream rules).

CuPy 14 refuses cuSPARSE during capture in ``cupy_backends/cuda/libs/cusparse.pyx``: the wrappers that
launch work call ``_setStream(handle)`` first, which raises ``NotImplementedError`` when the current
stream is capturing (the generic API's ``_bufferSize`` queries and the descriptor calls such as
``createCsr``/``createDnVec``/``destroySpMat`` take no handle or set no stream: they run in a capture
as they are). ``cupyx/cusparse.py`` looks the wrappers up on the module at each call
(``_cusparse.spMV``, ``getattr(_cusparse, 's' + name)``). While a capture routes CuPy, the names in
``SPECS`` become forwarders: on the capturing thread, with CuPy's cuSPARSE handle of the capture's
device and the capture stream current, the same ``cusparse`` entry point is called through ctypes on a
handle cgraw owns, bound to the capture stream, in pointer mode HOST (CuPy passes its alpha and beta
as NumPy scalars; a ``setPointerMode`` CuPy makes on its handle is mirrored), with CuPy's arguments
unchanged (a ``_bufferSize`` query returns what CuPy's wrapper returns). CuPy's handle is never touched;
cgraw's handles go back to an idle pool per device, unbound (stream 0), when the capture ends.

Routed: sparse @ dense vector and matrix (spMV, spMM: ``csr @ x``, ``csc @ x``, ``.dot``,
``.sum(axis=...)``), ``cupyx.cusparse.sparseToDense`` and csr2coo (``tocoo``), each verified on the
H200. ``csr_matrix.toarray`` still fails, as a host synchronisation: it calls
``coo_matrix.sum_duplicates``, which tests ``diff[1:].all()`` on the host.
Refused by name (``CaptureError``, kind ``CUSPARSE_NOT_COVERED``), before cuSPARSE runs: what sizes its
result on the host from a count of nonzeros the GPU computes (csrgeam2 for ``csr + csr``, spGEAM,
SpGEMM for ``csr @ csr``, denseToSparse, nnz, nnz_compress); csr2cscEx2 (``tocsc``), which on the H200
returned INTERNAL_ERROR inside a capture and broke the CUDA context; and the conversions no GPU test
reaches inside a capture (coo2csr, the index sorts, createIdentityPermutation, gather). A routed call
that invalidates the capture anyway is reported naming it.
"""

from __future__ import annotations

import ctypes
import sys

from cgraw.interop.cupy import route as _route

BACKEND = "cupy_backends.cuda.libs.cusparse"
# Argument kinds after the handle, in cuSPARSE's order: i int (and enums), p a pointer (device memory, a
# descriptor, or CuPy's host scalar); z a size_t the routine writes, which CuPy's wrapper does not take but
# returns. Orders follow CuPy 14.2's wrappers (signatures embedded in cusparse.cpython-311-x86_64-linux-gnu.so)
# and the CUDA 13 cuSPARSE docs.
SPECS: dict[str, str] = {}
for _names, _kinds in (
    ("spMV_bufferSize", "ipppppiiz"),
    ("spMV", "ipppppiip"),
    ("spMM_bufferSize", "iipppppiiz"),
    ("spMM", "iipppppiip"),
    ("sparseToDense_bufferSize", "ppiz"),
    ("sparseToDense", "ppip"),
    ("xcsr2coo", "piipi"),
):
    SPECS.update(dict.fromkeys(_names.split(), _kinds))
_GEAM = ("csrgeam2 (sparse + sparse) sizes its result on the host: cusparseXcsrgeam2Nnz writes the sum's "
         "number of nonzeros to host memory and CuPy allocates the result from it, which waits for the GPU")
_SPGEAM = ("SpGEAM (sparse + sparse) sizes its result on the host: CuPy reads the sum's number of nonzeros back "
           "(cusparseSpMatGetSize after cusparseSpGEAM_nnz) to allocate it, which waits for the GPU")
_SPGEMM = ("SpGEMM (sparse @ sparse) sizes its result on the host: CuPy reads the product's number of nonzeros "
           "back (cusparseSpMatGetSize) to allocate it, which waits for the GPU")
_DENSE2SPARSE = ("dense-to-sparse conversion counts the nonzeros on the GPU and CuPy reads the count back "
                 "(cusparseSpMatGetSize) to allocate the result, which waits for the GPU")
_NNZ = "it writes a count of nonzeros to host memory, from which CuPy sizes the result; that waits for the GPU"
_CSR2CSC = ("on the H200 csr2cscEx2 returned CUSPARSE_STATUS_INTERNAL_ERROR inside a capture and "
            "left an illegal-address error that broke the CUDA context for the rest of the process")
_UNVERIFIED = ("no GPU test reaches it inside a capture (CuPy's conversions that use it read a value on the host "
               "first), so cgraw does not route it: after csr2cscEx2, an unverified cuSPARSE call is refused")
REFUSED: dict[str, str] = {}
for _names, _why in (
    ("scsrgeam2_bufferSizeExt dcsrgeam2_bufferSizeExt ccsrgeam2_bufferSizeExt zcsrgeam2_bufferSizeExt "
     "xcsrgeam2Nnz scsrgeam2 dcsrgeam2 ccsrgeam2 zcsrgeam2", _GEAM),
    ("spGEAM_bufferSize spGEAM_nnz spGEAM", _SPGEAM),
    ("spGEMM_workEstimation spGEMM_compute spGEMM_copy", _SPGEMM),
    ("denseToSparse_bufferSize denseToSparse_analysis denseToSparse_convert", _DENSE2SPARSE),
    ("snnz dnnz cnnz znnz snnz_compress dnnz_compress cnnz_compress znnz_compress", _NNZ),
    ("csr2cscEx2_bufferSize csr2cscEx2", _CSR2CSC),
    ("xcoo2csr xcoosort_bufferSizeExt xcsrsort_bufferSizeExt xcscsort_bufferSizeExt xcoosortByRow "
     "xcoosortByColumn xcsrsort xcscsort createIdentityPermutation gather", _UNVERIFIED),
):
    REFUSED.update(dict.fromkeys(_names.split(), _why))
_SAME_STRUCTURE = ("add the matrices outside the capture; if both share one sparsity structure (same indices and "
                   "indptr), add their .data arrays inside it and build the matrix from the sum")
HINTS = {_GEAM: _SAME_STRUCTURE, _SPGEAM: _SAME_STRUCTURE,
         _CSR2CSC: ("convert outside the capture (tocsc/tocsr keep the structure: write new values into the "
                    "converted matrix's .data inside it), or use .T, which needs no conversion"),
         _SPGEMM: "multiply outside the capture, or keep one side dense: sparse @ dense is routed"}
STATUS = {1: "NOT_INITIALIZED", 2: "ALLOC_FAILED", 3: "INVALID_VALUE", 4: "ARCH_MISMATCH", 5: "MAPPING_ERROR",
          6: "EXECUTION_FAILED", 7: "INTERNAL_ERROR", 8: "MATRIX_TYPE_NOT_SUPPORTED", 9: "ZERO_PIVOT",
          10: "NOT_SUPPORTED", 11: "INSUFFICIENT_RESOURCES"}
POINTER_MODE_HOST = 0
CAPTURE_INVALIDATED = _route.CAPTURE_INVALIDATED
_CTYPES = {"i": ctypes.c_int, "p": ctypes.c_void_p, "z": ctypes.POINTER(ctypes.c_size_t)}
_OUTS = {"z": ctypes.c_size_t}
SONAMES = ("libcusparse.so.12", "libcusparse.so.11", "libcusparse.so")
API = _route.CApi("cuSPARSE", "cusparse", "libcusparse", BACKEND, STATUS, _CTYPES, _OUTS)
cupy_arity, symbol, _not_covered, _check = API.arity, API.symbol, API.not_covered, API.check


class Library(_route.CLibrary):
    """libcusparse through ctypes: each entry point resolved by name, its prototype from ``SPECS``."""

    label, statuses, api = "cuSPARSE", STATUS, API

    def set_pointer_mode(self, handle: int, mode: int) -> None:
        fn = self._symbol("setPointerMode", ("cusparseSetPointerMode",), [ctypes.c_void_p, ctypes.c_int])
        self._setup(fn, "cusparseSetPointerMode", handle, int(mode))


# libcusparse files to try: those this process has loaded (CuPy's first), then the sonames; library(): the
# libcusparse cgraw calls (loaded once), or None
candidate_paths, library, _backend = _route.library_parts(__name__, "libcusparse", SONAMES, BACKEND)
_routing = _route.Routing()
_routers, _patches, _idle = _routing.routers, _routing.patches, _routing.idle  # for tests and diagnosis
_library_cache: list = []  # [Library], once loaded


def router(pool, stream) -> "Router | None":
    """The cuSPARSE router of a capture that routes CuPy, or None (disabled with ``CGRAW_CUPY_CUSPARSE=0``,
    or this CuPy or libcusparse is not as expected): CuPy's cuSPARSE calls then meet CuPy's refusal."""
    return _route.handle_router(sys.modules[__name__], "CGRAW_CUPY_CUSPARSE", pool, stream)


class Router(_route.HandleRouter):
    """Routes CuPy's cuSPARSE calls of one capture (one thread, one device, the capture stream)."""

    owner = sys.modules[__name__]
    # CuPy's handle, made before the capture (enter): cusparseCreate allocates, which a capture refuses
    cupy_handle_getter = "get_cusparse_handle"

    def bind(self, handle: int) -> None:
        self.lib.set_pointer_mode(handle, POINTER_MODE_HOST)  # a pooled handle may carry a mirrored mode

    def mirror_pointer_mode(self, mode: int) -> None:
        """CuPy set the pointer mode of its handle: cgraw's handle takes it too."""
        self.lib.set_pointer_mode(self.handle, mode)


def _refuse(name: str, why: str, original):
    return _route.refuse(_routing, API, name, why, original, HINTS.get(why, ""))


def _mode_forwarder(original):
    def setPointerMode(handle, mode):  # noqa: N802 - CuPy's name
        original(handle, mode)  # CuPy's handle keeps the mode CuPy asked for
        r = _routing.active()
        if r is not None and handle == r.cupy_handle:
            r.mirror_pointer_mode(mode)

    return _route.named(setPointerMode, "setPointerMode", original)


def _install() -> None:
    backend = _backend()
    _route.install_specs(_routing, API, backend, SPECS)
    for name, why in REFUSED.items():
        fn = getattr(backend, name, None)
        if fn is not None:
            _routing.patch(backend, name, _refuse(name, why, fn))
    fn = getattr(backend, "setPointerMode", None)
    if callable(fn):
        _routing.patch(backend, "setPointerMode", _mode_forwarder(fn))

"""CuPy's dense cuSOLVER calls inside captures, on a cgraw-owned handle.
The GPU tier runs it on the H200 (``tests/gpu/test_cupy_libs.py``), the Jacobi substitution of gesvd
and Xsyevd (SUBSTITUTED) included; REFUSED names what it showed unsafe.

Layer L7: CuPy is reached through ``sys.modules``, cuSOLVER through ``ctypes``; the shared machinery
is ``interop.cupy.route``.

CuPy 14 refuses cuSOLVER during capture in ``cupy_backends/cuda/libs/cusolver.pyx``: ``setStream``
raises ``NotImplementedError('calling cuSOLVER API during stream capture is currently unsupported')``
when ``runtime.streamIsCapturing(stream)``, and every dense wrapper (the ``_bufferSize`` queries
too) calls it first through the C-level ``_setStream(handle)``. ``cupy.linalg`` and ``cupyx.lapack``
look the wrappers up on the module at each call (``cusolver.sgetrf``), and so does
``cupyx/_cusolver.pyx`` for gesvdj and syevj (``_cusolver.sgesvdjBatched``). While a capture routes
CuPy, the names in ``SPECS`` become forwarders: on the capturing thread, with CuPy's cuSOLVER handle
of the capture's device and the capture stream current, the same ``cusolverDn`` entry point is
called through ctypes on a handle cgraw owns, bound to the capture stream, with CuPy's arguments
unchanged (a ``_bufferSize`` query returns what CuPy's wrapper returns). CuPy's handle is never
touched; cgraw's handles go back to an idle pool per device, unbound (stream 0), when the capture ends.

Substituted (``SUBSTITUTED``): gesvd and Xsyevd synchronise inside cuSOLVER (on the H200 they
returned INTERNAL_ERROR in a capture and failed the thread's next cuSOLVER call), so they never reach it.
Up to 32x32 the router runs gesvdjBatched / syevjBatched (heevjBatched) with a batch of one instead:
``?gesvd_bufferSize`` adds room for the full U and V to the Jacobi workspace (CuPy allocates it in the
capture); ``?gesvd`` then copies the columns of U and rows of V^H that jobu/jobvt ask for where gesvd
writes them (CuPy elementwise copies on the capture stream); ``xsyevd_bufferSize`` gives the Jacobi
workspace in bytes, no host workspace. The info structures keep their defaults (values sorted as gesvd
and syevd sort them) and are made once per cgraw handle. So single-matrix ``svd``, ``eigh``, ``eigvalsh``,
``lstsq``, ``pinv``, ``matrix_rank``, ``norm(ord=2)``, ``cond`` and ``savgol_filter`` capture up to 32x32.
Deliberately unlike eager CuPy: another algorithm, so results differ from gesvd/syevd by rounding and the
vectors by sign (phase), which is not unique; the factorisation is the same (README, CuPy section).
Refused by name (``CaptureError``, kind ``CUSOLVER_NOT_COVERED``): the non-batched Jacobi routines
(gesvdj, syevj: they read their sweeps and residual back to the host), gesvdaStridedBatched (writes
residual norms to host memory), Xgeev (host workspace), gesvd/Xsyevd over 32x32, and ?syevd/?heevd
(which CuPy calls only on ROCm). A routed call that invalidates the capture anyway is reported naming it.
``cupyx/_cusolver.pyx``'s loops over gesvd and geqrf/orgqr (batched svd with matrices over 32,
batched qr) call the C functions directly: CuPy's own refusal, as before.
"""

from __future__ import annotations

import ctypes
import sys

from cgraw.interop.cupy import route as _route

BACKEND = "cupy_backends.cuda.libs.cusolver"
INFO_CHECK = "_check_cusolver_dev_info_if_synchronization_allowed"
# Argument kinds after the handle, in cuSOLVER's order: i int (and enums), p device pointer, q a
# parameter structure; o an int the routine writes, which CuPy's wrapper does not take but returns.
# Orders follow CuPy 14.2's wrappers (signatures embedded in cusolver.cpython-311-x86_64-linux-gnu.so)
# and the CUDA 13 cuSOLVER docs.
SPECS: dict[str, str] = {}
for _names, _kinds in (
    ("sgetrf_bufferSize dgetrf_bufferSize cgetrf_bufferSize zgetrf_bufferSize", "iipio"),
    ("sgetrf dgetrf cgetrf zgetrf", "iipippp"),
    ("sgetrs dgetrs cgetrs zgetrs", "iiipippip"),
    ("spotrf_bufferSize dpotrf_bufferSize cpotrf_bufferSize zpotrf_bufferSize", "iipio"),
    ("spotrf dpotrf cpotrf zpotrf", "iipipip"),
    ("spotrs dpotrs cpotrs zpotrs", "iiipipip"),
    ("spotrfBatched dpotrfBatched cpotrfBatched zpotrfBatched", "iipipi"),
    ("spotrsBatched dpotrsBatched cpotrsBatched zpotrsBatched", "iiipipipi"),
    ("sgeqrf_bufferSize dgeqrf_bufferSize cgeqrf_bufferSize zgeqrf_bufferSize", "iipio"),
    ("sgeqrf dgeqrf cgeqrf zgeqrf", "iipippip"),
    ("sorgqr_bufferSize dorgqr_bufferSize cungqr_bufferSize zungqr_bufferSize", "iiipipo"),
    ("sorgqr dorgqr cungqr zungqr", "iiipippip"),
    ("sormqr_bufferSize dormqr_bufferSize cunmqr_bufferSize zunmqr_bufferSize", "iiiiipippio"),
    ("sormqr dormqr cunmqr zunmqr", "iiiiipippipip"),
    ("sgesvdjBatched_bufferSize dgesvdjBatched_bufferSize cgesvdjBatched_bufferSize zgesvdjBatched_bufferSize",
     "iiipippipioqi"),
    ("sgesvdjBatched dgesvdjBatched cgesvdjBatched zgesvdjBatched", "iiipippipipipqi"),
    ("ssyevjBatched_bufferSize dsyevjBatched_bufferSize cheevjBatched_bufferSize zheevjBatched_bufferSize",
     "iiipipoqi"),
    ("ssyevjBatched dsyevjBatched cheevjBatched zheevjBatched", "iiipippipqi"),
):
    SPECS.update(dict.fromkeys(_names.split(), _kinds))
_JACOBI = ("iterates until it converges and reads its sweeps and residual back to the host "
           "(cusolverDnXsyevjGetSweeps/GetResidual report them), which a capture cannot")
# Measured on the H200 (CUDA 13 cuSOLVER): gesvd and syevd/Xsyevd inside a capture returned
# CUSOLVER_STATUS_INTERNAL_ERROR and invalidated it, and the next cuSOLVER call of that thread, eager,
# in CuPy or in torch, then failed once with EXECUTION_FAILED (a CUDA error left inside libcusolver).
# So they are refused before cuSOLVER is called at all.
_HYBRID = ("synchronises with the host inside cuSOLVER (on the H200 it returned CUSOLVER_STATUS_INTERNAL_ERROR "
           "and invalidated the capture), so cgraw refuses it before calling cuSOLVER")
REFUSED: dict[str, str] = {}
for _names, _why in (
    ("sgesvdj dgesvdj cgesvdj zgesvdj sgesvdj_bufferSize dgesvdj_bufferSize cgesvdj_bufferSize "
     "zgesvdj_bufferSize ssyevj dsyevj cheevj zheevj ssyevj_bufferSize dsyevj_bufferSize cheevj_bufferSize "
     "zheevj_bufferSize", _JACOBI),
    ("sgesvdaStridedBatched dgesvdaStridedBatched cgesvdaStridedBatched zgesvdaStridedBatched",
     "it writes the residual norms (h_R_nrmF) to host memory, which waits for the GPU"),
    ("xgeev xgeev_bufferSize", "cusolverDnXgeev works in a host workspace, which waits for the GPU"),
    # CuPy calls these only on ROCm (cupy/linalg/_eigenvalue.py::_syevd); on CUDA it calls Xsyevd
    ("ssyevd_bufferSize dsyevd_bufferSize cheevd_bufferSize zheevd_bufferSize ssyevd dsyevd cheevd zheevd", _HYBRID),
):
    REFUSED.update(dict.fromkeys(_names.split(), _why))
# gesvd and Xsyevd on matrices up to 32x32: run as gesvdjBatched / syevjBatched (heevjBatched) with a batch of
# one on cgraw's handle (Router._gesvd etc.); larger ones are refused naming the size.
JACOBI_MAX = 32
_JACOBI_SIZE = ("up to 32x32 is routed through the Jacobi routine; larger: do it outside the capture "
                "(gesvd and syevd synchronise inside cuSOLVER, which a capture cannot)")
SUBSTITUTED: dict[str, str] = {"xsyevd_bufferSize": "xsyevd_bufferSize", "xsyevd": "xsyevd"}
for _p in "sdcz":
    SUBSTITUTED.update({_p + "gesvd_bufferSize": "gesvd_bufferSize", _p + "gesvd": "gesvd"})
SUBSTITUTED_ARITY = {"gesvd_bufferSize": 3, "gesvd": 16, "xsyevd_bufferSize": 11, "xsyevd": 16}
EIG_MODE_NOVECTOR, EIG_MODE_VECTOR = 0, 1  # cusolverEigMode_t
_CUDA_TYPES = {0: "s", 1: "d", 4: "c", 5: "z"}  # cudaDataType of Xsyevd's A and W -> the precision
_REAL = {"s": "s", "d": "d", "c": "s", "z": "d"}
_ITEMSIZE = {"s": 4, "d": 8, "c": 8, "z": 16}
_DTYPES = {"s": "float32", "d": "float64", "c": "complex64", "z": "complex128"}
_NP_ITEMSIZE = {v: _ITEMSIZE[k] for k, v in _DTYPES.items()}
_EIGJ = {"s": "ssyevjBatched", "d": "dsyevjBatched", "c": "cheevjBatched", "z": "zheevjBatched"}
_BATCHED = ("pass a batch (..., M, M) of matrices up to 32x32: cupy.linalg.eigh, eigvalsh and svd use the batched "
            "Jacobi routines for stacked input, which cgraw routes; or call it outside the capture")
HINTS = {_JACOBI: _BATCHED, _HYBRID: _BATCHED}
STATUS = {1: "NOT_INITIALIZED", 2: "ALLOC_FAILED", 3: "INVALID_VALUE", 4: "ARCH_MISMATCH", 5: "MAPPING_ERROR",
          6: "EXECUTION_FAILED", 7: "INTERNAL_ERROR", 8: "MATRIX_TYPE_NOT_SUPPORTED", 9: "NOT_SUPPORTED"}
CAPTURE_INVALIDATED = _route.CAPTURE_INVALIDATED
_CTYPES = {"i": ctypes.c_int, "p": ctypes.c_void_p, "q": ctypes.c_void_p, "o": ctypes.POINTER(ctypes.c_int)}
_OUTS = {"o": ctypes.c_int}
SONAMES = ("libcusolver.so.12", "libcusolver.so.11", "libcusolver.so")
API = _route.CApi("cuSOLVER", "cusolverDn", "libcusolver", BACKEND, STATUS, _CTYPES, _OUTS)
cupy_arity, symbol, _not_covered, _check = API.arity, API.symbol, API.not_covered, API.check


class Library(_route.CLibrary):
    """libcusolver through ctypes: each entry point resolved by name, its prototype from ``SPECS``."""

    label, statuses, api = "cuSOLVER", STATUS, API

    def create_info(self, kind: str) -> int:
        """``cusolverDnCreate{kind}Info`` (kind ``Gesvdj`` or ``Syevj``): a host structure of defaults."""
        h = ctypes.c_void_p()
        sym = f"cusolverDnCreate{kind}Info"
        fn = self._symbol(sym, (sym,), [ctypes.POINTER(ctypes.c_void_p)])
        self._setup(fn, sym, ctypes.byref(h))
        return int(h.value or 0)


# libcusolver files to try: those this process has loaded (CuPy's first), then the sonames; library(): the
# libcusolver cgraw calls (loaded once), or None
candidate_paths, library, _backend = _route.library_parts(__name__, "libcusolver", SONAMES, BACKEND)
_routing = _route.Routing()
_routers, _patches, _idle = _routing.routers, _routing.patches, _routing.idle  # for tests and diagnosis
_library_cache: list = []  # [Library], once loaded
_jacobi_params: dict[tuple[int, str], int] = {}  # (cgraw handle, "Gesvdj"/"Syevj") -> its info structure


def router(pool, stream) -> "Router | None":
    """The cuSOLVER router of a capture that routes CuPy, or None (disabled with ``CGRAW_CUPY_CUSOLVER=0``,
    or this CuPy or libcusolver is not as expected): CuPy's cuSOLVER calls then meet CuPy's refusal."""
    return _route.handle_router(sys.modules[__name__], "CGRAW_CUPY_CUSOLVER", pool, stream)


class Router(_route.HandleRouter):
    """Routes CuPy's cuSOLVER calls of one capture (one thread, one device, the capture stream)."""

    owner = sys.modules[__name__]
    # CuPy's handle, made before the capture (enter): cusolverDnCreate allocates, which a capture refuses
    cupy_handle_getter = "get_cusolver_handle"

    def invalidated_note(self, status: int) -> str:
        return _stale_note(status)

    # ------------------------------------------------ gesvd and Xsyevd through the batched Jacobi routines

    def substitute(self, name: str, original, args: tuple):
        if self._get_stream().ptr != self.stream_ptr:
            return original(*args)  # not the capture stream: CuPy's own path
        how = SUBSTITUTED[name]
        if len(args) != SUBSTITUTED_ARITY[how]:
            raise _not_covered(name, f"CuPy passed {len(args)} arguments where cgraw's substitution expects "
                                     f"{SUBSTITUTED_ARITY[how]} (another CuPy version?)")
        return getattr(self, "_" + how)(name, args[1:])

    def _params(self, kind: str) -> int:
        """cgraw's ``gesvdjInfo_t``/``syevjInfo_t`` (defaults: tolerance, sweeps, sorted) of its handle,
        made once per handle (a host structure) and never destroyed, like the handle."""
        key = (self.handle, kind)
        p = _jacobi_params.get(key)
        if p is None:
            p = _jacobi_params[key] = self.lib.create_info(kind)
        return p

    def _svd_layout(self, p: str, m: int, n: int) -> tuple[int, int, int, int]:
        """Elements of ``p``'s dtype in the enlarged workspace: gesvdjBatched's own (rounded up to 256
        bytes), then scratch for its full U (m x m) and V (n x n); and where U and V start."""
        lwork = self.call(p + "gesvdjBatched_bufferSize", SPECS[p + "gesvdjBatched_bufferSize"],
                          (EIG_MODE_VECTOR, m, n, 0, max(m, 1), 0, 0, max(m, 1), 0, max(n, 1),
                           self._params("Gesvdj"), 1))
        align = 256 // _ITEMSIZE[p]
        jac = -(-max(lwork, 1) // align) * align
        return jac, jac, jac + m * m, jac + m * m + n * n

    def _gesvd_bufferSize(self, name: str, vals) -> int:
        m, n = (int(v) for v in vals)
        _jacobi_size(name, m, n)
        return self._svd_layout(name[0], m, n)[3]

    def _gesvd(self, name: str, vals) -> None:
        jobu, jobvt, m, n, a, lda, s, u, ldu, vt, ldvt, work, lwork, _rwork, info = vals
        p, m, n, lda, ldu, ldvt = name[0], int(m), int(n), int(lda), int(ldu), int(ldvt)
        jobu, jobvt = _job(jobu), _job(jobvt)
        _jacobi_size(name, m, n)
        k = min(m, n)
        if (jobu not in "ASON" or jobvt not in "ASON" or jobu == jobvt == "O" or lda < max(1, m)
                or (jobu in "AS" and ldu < max(1, m)) or (jobvt == "A" and ldvt < max(1, n))
                or (jobvt == "S" and ldvt < max(1, k))):
            _check(3, name)  # INVALID_VALUE, as gesvd reports it
        jac, u_off, v_off, total = self._svd_layout(p, m, n)
        if int(lwork) < total:
            raise _not_covered(name, f"its workspace has {lwork} elements where cgraw's Jacobi substitution needs "
                                     f"{total} (was {p}gesvd_bufferSize asked outside the capture?)")
        isz = _ITEMSIZE[p]
        vectors = jobu != "N" or jobvt != "N"
        ut, vj = int(work) + u_off * isz, int(work) + v_off * isz
        self.call(p + "gesvdjBatched", SPECS[p + "gesvdjBatched"],
                  (EIG_MODE_VECTOR if vectors else EIG_MODE_NOVECTOR, m, n, a, lda, s, ut, m, vj, n, work, jac,
                   info, self._params("Gesvdj"), 1))
        dtype = _DTYPES[p]
        if jobu != "N":  # gesvd's U (jobu A: m x m; S, O: m x k), in U or, for O, in A
            cols = m if jobu == "A" else k
            dst, ld = (a, lda) if jobu == "O" else (u, ldu)
            _copy(_device_array(dst, dtype, m, cols, ld, self.device),
                  _device_array(ut, dtype, m, cols, m, self.device), conj=False)
        if jobvt != "N":  # gesvd's VT = V^H (jobvt A: n x n; S, O: k x n), in VT or, for O, in A
            rows = n if jobvt == "A" else k
            dst, ld = (a, lda) if jobvt == "O" else (vt, ldvt)
            _copy(_device_array(dst, dtype, rows, n, ld, self.device),
                  _device_array(vj, dtype, n, rows, n, self.device).T, conj=p in "cz")

    def _eig_routine(self, name: str, vals) -> tuple[str, int]:
        """Xsyevd's arguments -> the precision of its Jacobi substitute and n; refused when not covered."""
        _params, _jobz, _uplo, n, type_a, _a, _lda, type_w, _w, compute = vals[:10]
        p = _CUDA_TYPES.get(int(type_a))
        if p is None or int(compute) != int(type_a) or _CUDA_TYPES.get(int(type_w)) != _REAL[p]:
            raise _not_covered(name, f"data types A={type_a}, W={type_w}, compute={compute}: cgraw substitutes "
                                     "syevjBatched/heevjBatched only for float32/64 and complex64/128")
        _jacobi_size(name, int(n), int(n))
        return p, int(n)

    def _eig_lwork(self, p: str, vals) -> int:
        _params, jobz, uplo, n, _ta, a, lda, _tw, w = vals[:9]
        routine = _EIGJ[p] + "_bufferSize"
        return self.call(routine, SPECS[routine], (jobz, uplo, n, a, lda, w, self._params("Syevj"), 1))

    def _xsyevd_bufferSize(self, name: str, vals) -> tuple[int, int]:
        p, _ = self._eig_routine(name, vals)
        return self._eig_lwork(p, vals) * _ITEMSIZE[p], 0  # bytes on the device; nothing on the host

    def _xsyevd(self, name: str, vals) -> None:
        p, n = self._eig_routine(name, vals)
        _params, jobz, uplo, _n, _ta, a, lda, _tw, w, _ct, work, work_bytes, _host, _host_bytes, info = vals
        lwork = self._eig_lwork(p, vals)
        if int(work_bytes) < lwork * _ITEMSIZE[p]:
            raise _not_covered(name, f"its device workspace has {work_bytes} bytes where cgraw's Jacobi substitution "
                                     f"needs {lwork * _ITEMSIZE[p]} (was xsyevd_bufferSize asked outside the capture?)")
        self.call(_EIGJ[p], SPECS[_EIGJ[p]], (jobz, uplo, n, a, lda, w, work, int(work_bytes) // _ITEMSIZE[p], info,
                                              self._params("Syevj"), 1))


def _job(v) -> str:
    """gesvd's jobu/jobvt as CuPy passes them (``ord('A')``) -> ``'A'``."""
    return v if isinstance(v, str) else chr(int(v))


def _jacobi_size(name: str, m: int, n: int) -> None:
    if max(m, n) > JACOBI_MAX:
        raise _not_covered(name, f"the matrix is {m}x{n}: {_JACOBI_SIZE}", "call it outside the capture and pass "
                                                                           "its result in")


def _device_array(ptr: int, dtype: str, rows: int, cols: int, ld: int, device: int):
    """A CuPy view of the column-major ``rows`` x ``cols`` matrix at ``ptr`` (leading dimension ``ld``),
    owned by its caller; elementwise operations on it run on CuPy's current (the capture) stream."""
    cp = sys.modules["cupy"]
    isz = _NP_ITEMSIZE[dtype]
    nbytes = ((cols - 1) * ld + rows) * isz
    mem = cp.cuda.UnownedMemory(int(ptr), nbytes, None, device)
    return cp.ndarray((rows, cols), dtype, cp.cuda.MemoryPointer(mem, 0), strides=(isz, ld * isz))


def _copy(dst, src, *, conj: bool) -> None:
    if conj:
        sys.modules["cupy"].conjugate(src, out=dst)
    else:
        dst[...] = src


def _stale_note(status: int) -> str:
    """What a failure inside the capture leaves behind (seen on the H200 with gesvd and syevd)."""
    if not status:
        return ""
    return (f" (it returned {API.status_name(status)}; the next cuSOLVER call of this "
            "thread, in CuPy or torch, may then fail once with EXECUTION_FAILED)")


def _refuse(name: str, why: str, original):
    return _route.refuse(_routing, API, name, why, original, HINTS.get(why, ""))


def _install() -> None:
    backend = _backend()
    _route.install_specs(_routing, API, backend, SPECS)
    for name, how in SUBSTITUTED.items():
        fn = getattr(backend, name, None)
        if fn is not None and _route.arity_ok(fn, SUBSTITUTED_ARITY[how]):
            _routing.patch(backend, name, _route.forwarder(
                _routing, name, fn, lambda r, args, name=name, fn=fn: r.substitute(name, fn, args)))
        elif fn is not None:  # another shape: still refused by name before cuSOLVER runs
            _routing.patch(backend, name, _refuse(name, _HYBRID, fn))
    for name, why in REFUSED.items():
        fn = getattr(backend, name, None)
        if fn is not None:
            _routing.patch(backend, name, _refuse(name, why, fn))
    _route.install_info_check(_routing, INFO_CHECK, "cuSOLVER")

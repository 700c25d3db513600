"""CuPy's dense cuSOLVER calls inside captures, on a cgraw-owned handle (issue 17, part 2).
Written without a GPU; first run on the H200 in session 9 (see REFUSED for what that changed).

Layer L7: CuPy is reached through ``sys.modules``, cuSOLVER through ``ctypes``; the shared machinery
is ``cupy_route``.

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

Refused by name (``CaptureError``, kind ``CUSOLVER_NOT_COVERED``): the non-batched Jacobi routines
(gesvdj, syevj: they read their sweeps and residual back to the host), gesvdaStridedBatched (writes
residual norms to host memory), Xgeev (host workspace), and gesvd and syevd/heevd/Xsyevd, which
synchronise inside cuSOLVER: on the H200 they returned CUSOLVER_STATUS_INTERNAL_ERROR inside a capture
and left a CUDA error in libcusolver that failed the thread's next cuSOLVER call, eager, in CuPy or
torch. So single-matrix ``eigh``/``eigvalsh``/``svd`` (and ``lstsq``, ``pinv``, ``matrix_rank``,
``norm(ord=2)``, ``cond``) are refused; stacked input of matrices up to 32x32 goes through the batched
Jacobi routines, which are routed. A routed call that invalidates the capture anyway is reported
naming it.
``cupyx/_cusolver.pyx``'s loops over gesvd and geqrf/orgqr (batched svd with matrices over 32,
batched qr) call the C functions directly: CuPy's own refusal, as before.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading

from cgraw.errors import CaptureError
from cgraw.interop import cupy_route as _route

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
# Measured on the H200 (CUDA 13 cuSOLVER, session 9): gesvd and syevd/Xsyevd inside a capture returned
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
    ("sgesvd_bufferSize dgesvd_bufferSize cgesvd_bufferSize zgesvd_bufferSize sgesvd dgesvd cgesvd zgesvd", _HYBRID),
    ("ssyevd_bufferSize dsyevd_bufferSize cheevd_bufferSize zheevd_bufferSize ssyevd dsyevd cheevd zheevd "
     "xsyevd_bufferSize xsyevd", _HYBRID),
):
    REFUSED.update(dict.fromkeys(_names.split(), _why))
_BATCHED = ("pass a batch (..., M, M) of matrices up to 32x32: cupy.linalg.eigh, eigvalsh and svd use the batched "
            "Jacobi routines for stacked input, which cgraw routes; or call it outside the capture")
HINTS = {_JACOBI: _BATCHED, _HYBRID: _BATCHED}
STATUS = {1: "NOT_INITIALIZED", 2: "ALLOC_FAILED", 3: "INVALID_VALUE", 4: "ARCH_MISMATCH", 5: "MAPPING_ERROR",
          6: "EXECUTION_FAILED", 7: "INTERNAL_ERROR", 8: "MATRIX_TYPE_NOT_SUPPORTED", 9: "NOT_SUPPORTED"}
CAPTURE_INVALIDATED = 2  # cuStreamIsCapturing's CU_STREAM_CAPTURE_STATUS_INVALIDATED
_RANGES = {"i": (-(1 << 31), (1 << 31) - 1)}
_CTYPES = {"i": ctypes.c_int, "p": ctypes.c_void_p, "q": ctypes.c_void_p, "o": ctypes.POINTER(ctypes.c_int)}
_OUTS = {"o": ctypes.c_int}
SONAMES = ("libcusolver.so.12", "libcusolver.so.11", "libcusolver.so")


def cupy_arity(kinds: str) -> int:
    """How many arguments CuPy's wrapper takes, the handle included (it returns the outputs)."""
    return 1 + sum(k not in _OUTS for k in kinds)


def symbol(name: str) -> str:
    """``sgetrf_bufferSize`` -> ``cusolverDnSgetrf_bufferSize``."""
    return "cusolverDn" + name[0].upper() + name[1:]


class Library(_route.CLibrary):
    """libcusolver through ctypes: each entry point resolved by name, its prototype from ``SPECS``."""

    label, statuses = "cuSOLVER", STATUS

    def function(self, name: str, kinds: str):
        fn = self._symbol(name, (symbol(name),), [ctypes.c_void_p, *(_CTYPES[k] for k in kinds)])
        if fn is None:
            raise _not_covered(name, f"this libcusolver ({self.path or '?'}) has no entry point for it")
        return fn

    def create(self) -> int:
        h = ctypes.c_void_p()
        fn = self._symbol("create", ("cusolverDnCreate",), [ctypes.POINTER(ctypes.c_void_p)])
        self._setup(fn, "cusolverDnCreate", ctypes.byref(h))
        return int(h.value or 0)

    def set_stream(self, handle: int, stream: int) -> None:
        fn = self._symbol("setStream", ("cusolverDnSetStream",), [ctypes.c_void_p, ctypes.c_void_p])
        self._setup(fn, "cusolverDnSetStream", handle, stream)


# libcusolver files to try: those this process has loaded (CuPy's first), then the sonames
candidate_paths = functools.partial(_route.candidate_paths, "libcusolver", SONAMES)


_routing = _route.Routing()
_routers, _patches, _idle = _routing.routers, _routing.patches, _routing.idle  # for tests and diagnosis
_library_cache: list = []  # [Library], once loaded


def library() -> Library | None:
    """The libcusolver cgraw calls (loaded once), or None."""
    return _route.load_once(_library_cache, candidate_paths, Library)


def _backend():
    return _route.import_backend(BACKEND)


def router(pool, stream) -> "Router | None":
    """The cuSOLVER router of a capture that routes CuPy, or None (disabled with ``CGRAW_CUPY_CUSOLVER=0``,
    or this CuPy or libcusolver is not as expected): CuPy's cuSOLVER calls then meet CuPy's refusal."""
    if _route.disabled("CGRAW_CUPY_CUSOLVER"):
        return None
    try:
        _backend()
        device_mod = sys.modules["cupy"].cuda.device
    except Exception:  # no cuSOLVER in this CuPy
        return None
    if not callable(getattr(device_mod, "get_cusolver_handle", None)):
        return None
    lib = library()
    return None if lib is None else Router(lib, pool.device.ordinal, stream.ptr,
                                           status=lambda: stream.capture_status)


class Router:
    """Routes CuPy's cuSOLVER calls of one capture (one thread, one device, the capture stream)."""

    def __init__(self, lib: Library, device: int, stream_ptr: int, *, status=None):
        self.lib, self.device, self.stream_ptr = lib, int(device), int(stream_ptr)
        self.thread = threading.get_ident()
        self.cupy_handle: int | None = None
        self.handle: int | None = None  # cgraw's: bound to the capture stream while the capture runs
        self.calls = 0  # cuSOLVER calls routed to cgraw's handle
        self._status = status  # the capture stream's capture status (2: invalidated); None: not checked
        self._get_stream = None

    def producer_streams(self) -> list[int]:
        return []

    def enter(self) -> None:
        cupy = sys.modules["cupy"]
        with cupy.cuda.Device(self.device):
            # made before the capture: cusolverDnCreate allocates, which a capture refuses
            self.cupy_handle = int(cupy.cuda.device.get_cusolver_handle())
        self._get_stream = cupy.cuda.get_current_stream
        self.handle, _ = _routing.take_handle(self.device, self.lib.create)
        try:
            self.lib.set_stream(self.handle, self.stream_ptr)
            _routing.register(self, _install)
        except BaseException:
            _routing.unregister(self)
            try:
                self._release_handle()
            except Exception:  # the handle is leaked; the first error is the one to report
                pass
            raise

    def exit(self, failed: bool = False) -> None:
        _routing.unregister(self)
        self._release_handle()

    def _release_handle(self) -> None:
        h, self.handle = self.handle, None
        if h is not None:
            self.lib.set_stream(h, 0)
            _routing.put_back(self.device, h)  # if that failed, the handle is leaked instead

    def run(self, name: str, kinds: str, original, args: tuple):
        if self._get_stream().ptr != self.stream_ptr:
            return original(*args)  # not the capture stream: CuPy's own path (eager, or its refusal)
        vals = list(args[1:])
        if len(args) != cupy_arity(kinds):
            raise _not_covered(name, f"CuPy passed {len(args)} arguments where cgraw's table has "
                                     f"{cupy_arity(kinds)} (another CuPy version?)")
        ins = [k for k in kinds if k not in _OUTS]
        for k, v in zip(ins, vals, strict=True):
            lo_hi = _RANGES.get(k)
            if lo_hi is not None and not lo_hi[0] <= int(v) <= lo_hi[1]:  # ctypes would truncate it silently
                raise _not_covered(name, f"the argument {v} does not fit in its C type")
        outs = [_OUTS[k]() for k in kinds if k in _OUTS]
        it_in, it_out, cargs = iter(vals), iter(outs), []
        for k in kinds:
            cargs.append(ctypes.byref(next(it_out)) if k in _OUTS else next(it_in))
        fn = self.lib.function(name, kinds)
        self.calls += 1
        status = fn(self.handle, *cargs)
        if self._status is not None and self._status() == CAPTURE_INVALIDATED:
            raise _not_covered(name, "it synchronised with the host inside the capture, which invalidated it"
                               + _stale_note(status))
        _check(status, name)
        return int(outs[0].value) if outs else None  # a _bufferSize query's one output


def _check(status: int, name: str) -> None:
    if status:
        check = getattr(sys.modules.get(BACKEND), "check_status", None)
        if check is not None:
            check(int(status))  # CuPy's own CUSOLVERError, as eager CuPy raises it
        raise CaptureError(symbol(name), int(status), f"CUSOLVER_STATUS_{STATUS.get(status, status)}",
                           f"cuSOLVER {name} failed inside the capture")


def _stale_note(status: int) -> str:
    """What a failure inside the capture leaves behind (seen on the H200 with gesvd and syevd)."""
    if not status:
        return ""
    return (f" (it returned CUSOLVER_STATUS_{STATUS.get(status, status)}; the next cuSOLVER call of this "
            "thread, in CuPy or torch, may then fail once with EXECUTION_FAILED)")


def _not_covered(name: str, why: str, hint: str = "") -> CaptureError:
    return CaptureError(f"{BACKEND}.{name}", 0, "CUSOLVER_NOT_COVERED",
                        f"{_route.entry_point()} calls cuSOLVER {name} ({symbol(name)}), which cannot be captured "
                        f"through cgraw: {why}",
                        hint or "call it outside the capture and pass its result in")


def _refuse(name: str, why: str, original):
    def run(r, args):
        if r._get_stream().ptr != r.stream_ptr:
            return original(*args)
        raise _not_covered(name, why, HINTS.get(why, ""))

    return _route.forwarder(_routing, name, original, run)


def _install() -> None:
    backend = _backend()
    for name, kinds in SPECS.items():
        fn = getattr(backend, name, None)
        if fn is not None and _route.arity_ok(fn, cupy_arity(kinds)):  # a wrapper of another shape stays CuPy's
            _routing.patch(backend, name, _route.forwarder(
                _routing, name, fn, lambda r, args, name=name, kinds=kinds, fn=fn: r.run(name, kinds, fn, args)))
    for name, why in REFUSED.items():
        fn = getattr(backend, name, None)
        if fn is not None:
            _routing.patch(backend, name, _refuse(name, why, fn))
    _route.install_info_check(_routing, INFO_CHECK, "cuSOLVER")

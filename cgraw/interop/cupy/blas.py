"""CuPy's cuBLAS calls inside captures, on a cgraw-owned handle; the GPU tier runs it on the H200.

Layer L7: CuPy is reached through ``sys.modules``, cuBLAS through ``ctypes``.

CuPy 14 refuses cuBLAS during capture in ``cupy_backends/cuda/libs/cublas.pyx``: ``setStream``
raises ``NotImplementedError('calling cuBLAS API during stream capture is currently unsupported')``
when ``runtime.streamIsCapturing(stream)``, and every BLAS wrapper there calls it first
(``_setStream(handle)``, a C call inside the module: it cannot be replaced). The callers
(``cupy/_core/_routines_linalg.pyx``: ``@``, ``dot``, ``inner``, ``tensordot``, ``einsum``, batched
matmul; ``cupy/cublas.py``; ``cupy/linalg``) look the wrappers up on the module at each call. While a
capture routes CuPy, the names in ``SPECS`` become forwarders: on the capturing thread, for CuPy's
handle of the capture's device and with the capture stream current, the same cuBLAS entry point is
called through ctypes on a handle cgraw owns, bound to the capture stream (``cublasSetStream``) with
a workspace from the graph's pool (``cublasSetWorkspace``, as torch does) and CuPy's pointer and
math modes; any other call goes to CuPy unchanged (eager, or its refusal). CuPy's handle is never
rebound; modes CuPy sets are mirrored on both handles and put back after the capture; the
originals return once no capture routes. ``cupy.linalg._util``'s info checks refuse, naming the
call, when ``cupyx.errstate(linalg='raise')`` would make them synchronise.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

from cgraw.errors import CaptureError
from cgraw.interop.cupy import route as _route

# Argument kinds after the handle: e enum/int, i int, n int (int64 in cuBLAS's ``_64`` API), p pointer,
# L long long, r a result pointer (device memory unless the pointer mode is HOST), E a compute type
# (a cudaDataType below 64 is migrated as cuBLAS's C++ overloads do). Orders follow CuPy 14's wrappers.
SPECS: dict[str, str] = {}
for _names, _kinds in (
    ("sgemm dgemm cgemm zgemm", "eennnppnpnppn"),
    ("sgemmBatched dgemmBatched cgemmBatched zgemmBatched", "eennnppnpnppnn"),
    ("sgemmStridedBatched dgemmStridedBatched cgemmStridedBatched zgemmStridedBatched", "eennnppnLpnLppnLn"),
    ("sgemmEx", "eennnppenpenppen"),
    ("gemmEx", "eennnppenpenppenEe"),
    ("gemmBatchedEx", "eennnppenpenppennEe"),
    ("gemmStridedBatchedEx", "eennnppenLpenLppenLnEe"),
    ("sgemv dgemv cgemv zgemv ssbmv dsbmv", "ennppnpnppn"),
    ("sger dger cgeru cgerc zgeru zgerc", "nnppnpnpn"),
    ("sdot ddot cdotu cdotc zdotu zdotc", "npnpnr"),
    ("snrm2 dnrm2 scnrm2 dznrm2 sasum dasum scasum dzasum", "npnr"),
    ("saxpy daxpy caxpy zaxpy", "nppnpn"),
    ("sscal dscal cscal csscal zscal zdscal", "nppn"),
    ("strsm dtrsm ctrsm ztrsm", "eeeennppnpn"),
    ("strsmBatched dtrsmBatched ctrsmBatched ztrsmBatched", "eeeennppnpnn"),
    ("ssyrk dsyrk csyrk zsyrk", "eennppnppn"),
    ("sgeam dgeam cgeam zgeam", "eennppnppnpn"),
    ("sdgmm ddgmm cdgmm zdgmm", "ennpnpnpn"),
    ("sgetrfBatched dgetrfBatched cgetrfBatched zgetrfBatched", "ipippi"),
    ("sgetrsBatched dgetrsBatched cgetrsBatched zgetrsBatched", "eiipippipi"),
    ("sgetriBatched dgetriBatched cgetriBatched zgetriBatched", "ipippipi"),
):
    SPECS.update(dict.fromkeys(_names.split(), _kinds))
MODE_SETTERS = ("setPointerMode", "setMathMode")
INFO_CHECKS = {"_check_cublas_info_array_if_synchronization_allowed": "cuBLAS"}  # cuSOLVER's: interop.cupy.solver
BACKEND = "cupy_backends.cuda.libs.cublas"
POINTER_MODE_HOST, PEDANTIC_MATH, NOT_SUPPORTED = 0, 2, 15
# cudaDataType -> cublasComputeType_t (R_32F, C_32F -> 32F; R_64F, C_64F -> 64F; R_16F -> 16F; R_32I -> 32I);
# the pedantic variant is one more
MIGRATE = {0: 68, 4: 68, 1: 70, 5: 70, 2: 64, 10: 72}
STATUS = {1: "NOT_INITIALIZED", 3: "ALLOC_FAILED", 7: "INVALID_VALUE", 8: "ARCH_MISMATCH", 11: "MAPPING_ERROR",
          13: "EXECUTION_FAILED", 14: "INTERNAL_ERROR", 15: "NOT_SUPPORTED", 16: "LICENSE_ERROR"}
_I32 = (-(1 << 31), (1 << 31) - 1)
_CTYPES = {"e": ctypes.c_int, "E": ctypes.c_int, "i": ctypes.c_int, "n": ctypes.c_int, "p": ctypes.c_void_p,
           "r": ctypes.c_void_p, "L": ctypes.c_longlong}


def migrate_compute_type(compute_type: int, math_mode: int) -> int | None:
    """The ``cublasComputeType_t`` for ``compute_type`` (None: cuBLAS would return NOT_SUPPORTED)."""
    base = compute_type if compute_type >= 64 else MIGRATE.get(compute_type)
    return base + 1 if compute_type < 64 and base is not None and (math_mode & 0xF) == PEDANTIC_MATH else base


def workspace_nbytes(cc_major: int, environ=os.environ) -> int:
    """The workspace a capture's cuBLAS calls get: ``CGRAW_CUBLAS_WORKSPACE_BYTES``, else cuBLAS's
    ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KIB:COUNT`` pairs), else torch's defaults: 32 MiB from
    Hopper on, 8 MiB + 128 KiB before."""
    raw = environ.get("CGRAW_CUBLAS_WORKSPACE_BYTES", "").strip()
    if raw:
        return max(int(raw), 0)
    pairs = [p for p in environ.get("CUBLAS_WORKSPACE_CONFIG", "").split(":") if p.strip()]
    if pairs and len(pairs) % 2 == 0 and all(p.strip().isdigit() for p in pairs):
        return sum(int(pairs[i]) * 1024 * int(pairs[i + 1]) for i in range(0, len(pairs), 2))
    return 32 << 20 if cc_major >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8


class Library(_route.CLibrary):
    """cuBLAS through ctypes: each entry point resolved by name, its prototype from ``SPECS``."""

    label, statuses = "cuBLAS", STATUS

    def _bind(self, key, base: str, wide: bool, argtypes: list):
        # the _v2 names first: libcublas also exports the legacy API (no handle) under the plain ones
        return self._symbol(key, [f"cublas{base}{v}{'_64' if wide else ''}" for v in ("_v2", "")], argtypes)

    def function(self, name: str, kinds: str, wide: bool = False):
        types = [ctypes.c_int64 if wide and k == "n" else _CTYPES[k] for k in kinds]
        fn = self._bind((name, wide), name[0].upper() + name[1:], wide, [ctypes.c_void_p, *types])
        if fn is None:
            raise _not_covered(name, f"this libcublas ({self.path or '?'}) has no {'64-bit ' * wide}entry point for it")
        return fn

    def _call(self, base: str, argtypes: list, *args) -> None:
        self._setup(self._bind(base, base, False, argtypes), f"cublas{base}", *args)

    def create(self) -> int:
        h = ctypes.c_void_p()
        self._call("Create", [ctypes.POINTER(ctypes.c_void_p)], ctypes.byref(h))
        return int(h.value or 0)

    def set_stream(self, handle: int, stream: int) -> None:
        self._call("SetStream", [ctypes.c_void_p, ctypes.c_void_p], handle, stream)

    def set_workspace(self, handle: int, ptr: int, nbytes: int) -> None:
        self._call("SetWorkspace", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], handle, ptr, nbytes)

    def set_mode(self, setter: str, handle: int, mode: int) -> None:
        """``setter``: ``"setPointerMode"`` or ``"setMathMode"``, as CuPy names them."""
        self._call("S" + setter[1:], [ctypes.c_void_p, ctypes.c_int], handle, int(mode))


SONAMES = ("libcublas.so.13", "libcublas.so.12", "libcublas.so")


# libcublas files to try: those this process has loaded (CuPy's first), then the sonames; library(): the
# libcublas cgraw calls (loaded once), or None
candidate_paths, library, _backend = _route.library_parts(__name__, "libcublas", SONAMES, BACKEND)
_routing = _route.Routing()
_routers, _patches, _idle = _routing.routers, _routing.patches, _routing.idle  # for tests and diagnosis
_library_cache: list = []  # [Library], once loaded


def router(pool, stream, *, warm: bool = True) -> "Router | None":
    """The cuBLAS router of a capture that routes CuPy, or None (disabled with ``CGRAW_CUPY_CUBLAS=0``,
    or this CuPy or libcublas is not as expected): CuPy's cuBLAS calls then meet CuPy's refusal."""
    if _route.disabled("CGRAW_CUPY_CUBLAS"):
        return None
    try:
        backend = _backend()
    except Exception:  # no cuBLAS in this CuPy
        return None
    if not all(callable(getattr(backend, n, None)) for n in ("getPointerMode", "getMathMode", *MODE_SETTERS)):
        return None
    lib = library()
    return None if lib is None else Router(lib, pool.device.ordinal, stream.ptr, warm=warm)


class Router:
    """Routes CuPy's cuBLAS calls of one capture (one thread, one device, the capture stream)."""

    def __init__(self, lib: Library, device: int, stream_ptr: int, *, warm: bool = True,
                 workspace: int | None = None):
        self.lib, self.device, self.stream_ptr, self.warm = lib, int(device), int(stream_ptr), warm
        self.thread = threading.get_ident()
        self.workspace_nbytes = workspace  # None: workspace_nbytes() for the device, at enter
        self.cupy_handle: int | None = None
        self.handle: int | None = None  # cgraw's: bound to the capture stream while the capture runs
        self.pointer_mode = self.math_mode = 0
        self.calls = 0  # cuBLAS calls routed to cgraw's handle
        self._modes_at_enter = self._get_stream = None
        self._workspace = None  # the CuPy array (a block of the graph's pool) bound as the workspace

    def producer_streams(self) -> list[int]:
        return []

    def enter(self) -> None:
        cupy, backend = sys.modules["cupy"], _backend()
        with cupy.cuda.Device(self.device):
            self.cupy_handle = int(cupy.cuda.device.get_cublas_handle())
            modes = (int(backend.getPointerMode(self.cupy_handle)), int(backend.getMathMode(self.cupy_handle)))
            if self.workspace_nbytes is None:
                self.workspace_nbytes = workspace_nbytes(int(cupy.cuda.Device(self.device).compute_capability) // 10)
        self._modes_at_enter = modes
        self.pointer_mode, self.math_mode = modes
        self._get_stream = cupy.cuda.get_current_stream
        self.handle, fresh = _routing.take_handle(self.device, self.lib.create)
        try:
            self.lib.set_stream(self.handle, self.stream_ptr)
            if fresh and self.warm:
                self._warm_up(cupy)
            for setter, mode in zip(MODE_SETTERS, modes, strict=True):
                self.lib.set_mode(setter, self.handle, mode)
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
        modes, self._modes_at_enter = self._modes_at_enter, None
        try:
            backend = _backend()
            for setter, mode in zip(MODE_SETTERS, modes or (), strict=False):  # CuPy's handle as it was
                if int(getattr(backend, "g" + setter[1:])(self.cupy_handle)) != mode:
                    getattr(backend, setter)(self.cupy_handle, mode)
        finally:
            try:
                self._release_handle()
            finally:
                self._workspace = None  # back to the pool, after the handle let go of it

    def _warm_up(self, cupy) -> None:
        """One 1x1 GEMM on a new handle before the capture: cuBLAS's lazy set-up happens here."""
        buf = cupy.zeros(3, dtype=cupy.float32)
        one, zero, p = ctypes.c_float(1.0), ctypes.c_float(0.0), int(buf.data.ptr)
        fn = self.lib.function("sgemm", SPECS["sgemm"])
        _check(fn(self.handle, 0, 0, 1, 1, 1, ctypes.addressof(one), p, 1, p + 4, 1, ctypes.addressof(zero),
                  p + 8, 1), "sgemm")

    def _release_handle(self) -> None:
        h, self.handle = self.handle, None
        if h is not None:
            self.lib.set_stream(h, 0)  # also drops the workspace (cuBLAS resets it to its default)
            _routing.put_back(self.device, h)  # if that failed, the handle is leaked instead

    def mirror(self, setter: str, mode: int) -> None:
        """CuPy set a mode on its handle: cgraw's handle takes it too."""
        self.lib.set_mode(setter, self.handle, mode)
        if setter == "setPointerMode":
            self.pointer_mode = int(mode)
        else:
            self.math_mode = int(mode)

    def run(self, name: str, kinds: str, original, args: tuple):
        if self._get_stream().ptr != self.stream_ptr:
            return original(*args)  # not the capture stream: CuPy's own path (eager, or its refusal)
        vals = list(args[1:])
        if len(vals) != len(kinds):
            raise _not_covered(name, f"CuPy passed {len(args)} arguments where cgraw's table has {len(kinds) + 1} "
                                     "(another CuPy version?)")
        if "r" in kinds and self.pointer_mode == POINTER_MODE_HOST:
            raise _not_covered(name, "it would write its result to host memory (pointer mode HOST: a NumPy out=), "
                                     "which waits for the GPU", "pass a CuPy array as out=, or call it outside")
        if "E" in kinds:
            i = kinds.index("E")
            vals[i] = migrate_compute_type(int(vals[i]), self.math_mode)
            if vals[i] is None:
                _check(NOT_SUPPORTED, name)
        wide = False
        for k, v in zip(kinds, vals, strict=True):
            if k in "eEin" and not _I32[0] <= int(v) <= _I32[1]:
                if k != "n":  # ctypes would truncate it silently
                    raise _not_covered(name, f"the argument {v} does not fit in a C int")
                wide = True  # cuBLAS's _64 entry point
        fn = self.lib.function(name, kinds, wide)
        if self._workspace is None:  # the first routed call of the capture
            self._bind_workspace()
        self.calls += 1
        _check(fn(self.handle, *vals), name)

    def _bind_workspace(self) -> None:
        nbytes, cupy = int(self.workspace_nbytes or 0), sys.modules["cupy"]
        if nbytes <= 0:
            self._workspace = ()  # cuBLAS's own default workspace
            return
        ws = cupy.empty((nbytes,), dtype=cupy.uint8)  # a block of the graph's pool, on the capture stream
        self.lib.set_workspace(self.handle, int(ws.data.ptr), nbytes)
        self._workspace = ws


def _check(status: int, name: str) -> None:
    if status:
        check = getattr(sys.modules.get(BACKEND), "check_status", None)
        if check is not None:
            check(int(status))  # CuPy's own CUBLASError, as eager CuPy raises it
        raise CaptureError(f"cublas.{name}", int(status), f"CUBLAS_STATUS_{STATUS.get(status, status)}",
                           f"cuBLAS {name} failed inside the capture")


def _not_covered(name: str, why: str, hint: str = "") -> CaptureError:
    return CaptureError(f"{BACKEND}.{name}", 0, "CUBLAS_NOT_COVERED",
                        f"cuBLAS {name} cannot be captured through cgraw: {why}",
                        hint or "do this product outside the capture, or with torch inside it (zero-copy DLPack)")


# ---------------------------------------------------------------- forwarders


def _forwarder(name: str, kinds: str, original):
    return _route.forwarder(_routing, name, original, lambda r, args: r.run(name, kinds, original, args))


def _mode_forwarder(name: str, original):
    def forward(handle, mode):
        original(handle, mode)  # CuPy's handle keeps the mode CuPy asked for
        r = _routing.active()
        if r is not None and handle == r.cupy_handle:
            r.mirror(name, mode)

    return _route.named(forward, name, original)


def _install() -> None:
    backend = _backend()
    for name, kinds in SPECS.items():
        fn = getattr(backend, name, None)
        if fn is not None and _route.arity_ok(fn, len(kinds) + 1):  # a wrapper of another shape stays CuPy's
            _routing.patch(backend, name, _forwarder(name, kinds, fn))
    for name in MODE_SETTERS:
        _routing.patch(backend, name, _mode_forwarder(name, getattr(backend, name)))
    for name, library_name in INFO_CHECKS.items():
        _route.install_info_check(_routing, name, library_name)

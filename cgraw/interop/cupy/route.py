"""What the routers of CuPy's library calls inside captures share (``interop.cupy.blas``: cuBLAS,
``interop.cupy.solver``: cuSOLVER, ``interop.cupy.sparse``: cuSPARSE).

Layer L7: pure Python and ``ctypes``; CuPy is reached through ``sys.modules``. Each library keeps
one ``Routing``: the router of each capturing thread, the CuPy functions replaced while any
router runs (put back when the last one ends), and the idle handles of each device (reused by the
next capture, never destroyed). A forwarder sends a call to its thread's router only when CuPy
passed its own handle of the capture; anything else is CuPy's call, unchanged. ``library_parts``,
``handle_router`` and ``HandleRouter`` are the module wiring, ``router()`` factory and router that
``interop.cupy.solver`` and ``interop.cupy.sparse`` share (``interop.cupy.blas`` shares the wiring only); ``CApi`` is what
those two know of their library's calls (names, argument kinds, errors), ``CLibrary`` its ctypes side.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import os
import sys
import threading

from cgraw.errors import CaptureError

OFF = ("0", "false", "no", "off")
CAPTURE_INVALIDATED = 2  # cuStreamIsCapturing's CU_STREAM_CAPTURE_STATUS_INVALIDATED
INT_RANGE = {"i": (-(1 << 31), (1 << 31) - 1)}  # argument kinds whose values must fit a C int


def disabled(env_name: str, environ=os.environ) -> bool:
    """Whether the environment turns a router off (``CGRAW_CUPY_CUBLAS=0``, ``CGRAW_CUPY_CUSPARSE=0``, ...)."""
    return environ.get(env_name, "1").strip().lower() in OFF


def candidate_paths(stem: str, sonames: tuple[str, ...], maps_text: str | None = None) -> list[str]:
    """``stem``'s library files to try: those this process has loaded (CuPy's first), then ``sonames``."""
    if maps_text is None:
        try:
            with open("/proc/self/maps") as f:
                maps_text = f.read()
        except OSError:
            maps_text = ""
    paths = (line.split()[-1] for line in maps_text.splitlines() if "/" in line)
    loaded = list(dict.fromkeys(p for p in paths if os.path.basename(p).startswith(stem + ".so")))
    return sorted(loaded, key=lambda p: "cupy" not in p) + list(sonames)


def import_backend(name: str):
    """CuPy's wrapper module ``name`` (already imported by CuPy in practice)."""
    mod = sys.modules.get(name)
    return mod if mod is not None else importlib.import_module(name)


def load_once(cache: list, paths, make):
    """The library in ``cache``, else the first of ``paths()`` that loads, wrapped by ``make(dll, path)``."""
    for path in () if cache else paths():
        try:
            cache.append(make(ctypes.CDLL(path), path))
            break
        except OSError:
            continue
    return cache[0] if cache else None


def library_parts(module: str, stem: str, sonames: tuple[str, ...], backend: str):
    """A router module's ``candidate_paths`` (``stem``'s files to try), ``library()`` and ``_backend()``
    (CuPy's wrapper module ``backend``). ``library()`` loads the module's ``Library`` once into its
    ``_library_cache``, reading those names (and ``candidate_paths``) from the module at each call."""

    def library():
        mod = sys.modules[module]
        return load_once(mod._library_cache, mod.candidate_paths, mod.Library)

    def backend_module():
        return import_backend(backend)

    library.__doc__ = f"The {stem} cgraw calls (loaded once), or None."
    return functools.partial(candidate_paths, stem, sonames), library, backend_module


def handle_router(owner, env_name: str, pool, stream):
    """``owner.Router`` for a capture that routes CuPy (``owner``: the library's module), or None: turned
    off with ``env_name=0``, or this CuPy or the C library is not as expected."""
    if disabled(env_name):
        return None
    try:
        owner._backend()
        device_mod = sys.modules["cupy"].cuda.device
    except Exception:  # no such library in this CuPy
        return None
    if not callable(getattr(device_mod, owner.Router.cupy_handle_getter, None)):
        return None
    lib = owner.library()
    return None if lib is None else owner.Router(lib, pool.device.ordinal, stream.ptr,
                                                 status=lambda: stream.capture_status)


class CApi:
    """What cgraw knows of one C library's calls that CuPy wraps: ``label`` ("cuSPARSE"), the
    symbol ``prefix`` ("cusparse"), the file ``stem`` ("libcusparse"), CuPy's wrapper module
    ``backend``, status names, and the ctypes type of each argument kind (``ctypes_of``), those the
    routine writes and CuPy returns (``outs``: kind -> ctypes type) included."""

    def __init__(self, label: str, prefix: str, stem: str, backend: str, statuses: dict, ctypes_of: dict,
                 outs: dict):
        self.label, self.prefix, self.stem, self.backend = label, prefix, stem, backend
        self.statuses, self.ctypes_of, self.outs = statuses, ctypes_of, outs

    def symbol(self, name: str) -> str:
        """``spMV_bufferSize`` -> ``cusparseSpMV_bufferSize``."""
        return self.prefix + name[0].upper() + name[1:]

    def arity(self, kinds: str) -> int:
        """How many arguments CuPy's wrapper takes, the handle included (it returns the outputs)."""
        return 1 + sum(k not in self.outs for k in kinds)

    def status_name(self, status: int) -> str:
        return f"{self.label.upper()}_STATUS_{self.statuses.get(status, status)}"

    def not_covered(self, name: str, why: str, hint: str = "") -> CaptureError:
        return CaptureError(f"{self.backend}.{name}", 0, f"{self.label.upper()}_NOT_COVERED",
                            f"{entry_point()} calls {self.label} {name} ({self.symbol(name)}), which cannot be "
                            f"captured through cgraw: {why}",
                            hint or "call it outside the capture and pass its result in")

    def check(self, status: int, name: str) -> None:
        """Raise for a failed call: CuPy's own error (as eager CuPy raises it), else a ``CaptureError``."""
        if status:
            check = getattr(sys.modules.get(self.backend), "check_status", None)
            if check is not None:
                check(int(status))
            raise CaptureError(self.symbol(name), int(status), self.status_name(status),
                               f"{self.label} {name} failed inside the capture")

    def marshal(self, name: str, kinds: str, vals) -> tuple[list, list]:
        """``(C arguments, outputs)`` of ``name`` for CuPy's arguments after the handle; a value its C
        type cannot hold is refused (ctypes would truncate it silently)."""
        outs_of = self.outs
        for k, v in zip((k for k in kinds if k not in outs_of), vals, strict=True):
            lo_hi = INT_RANGE.get(k)
            if lo_hi is not None and not lo_hi[0] <= int(v) <= lo_hi[1]:
                raise self.not_covered(name, f"the argument {v} does not fit in its C type")
        outs = [outs_of[k]() for k in kinds if k in outs_of]
        it_in, it_out = iter(vals), iter(outs)
        return [ctypes.byref(next(it_out)) if k in outs_of else next(it_in) for k in kinds], outs


def refuse(routing: "Routing", api: CApi, name: str, why: str, original, hint: str = ""):
    """``original`` refused by name (``why``) when its thread's router's capture stream is current."""

    def run(r, args):
        if r._get_stream().ptr != r.stream_ptr:
            return original(*args)
        raise api.not_covered(name, why, hint)

    return forwarder(routing, name, original, run)


def install_specs(routing: "Routing", api: CApi, backend, specs: dict) -> None:
    """CuPy's wrappers of ``specs`` (name -> argument kinds) routed to ``Router.run``; a wrapper of
    another shape stays CuPy's."""
    for name, kinds in specs.items():
        fn = getattr(backend, name, None)
        if fn is not None and arity_ok(fn, api.arity(kinds)):
            routing.patch(backend, name, forwarder(
                routing, name, fn, lambda r, args, name=name, kinds=kinds, fn=fn: r.run(name, kinds, fn, args)))


class HandleRouter:
    """Routes one library's CuPy calls of one capture (one thread, one device, the capture stream) to a
    handle cgraw owns. A subclass sets ``owner`` (its module, whose ``_routing`` and ``_install`` are read
    at each use) and ``cupy_handle_getter`` (``cupy.cuda.device``'s getter of CuPy's handle), and sets up
    cgraw's handle for the capture in ``bind``."""

    owner = None  # the library's module (interop.cupy.solver, interop.cupy.sparse)
    cupy_handle_getter = ""  # "get_cusolver_handle"

    def __init__(self, lib, device: int, stream_ptr: int, *, status=None):
        self.lib, self.device, self.stream_ptr = lib, int(device), int(stream_ptr)
        self.thread = threading.get_ident()
        self.cupy_handle: int | None = None
        self.handle: int | None = None  # cgraw's: bound to the capture stream while the capture runs
        self.calls = 0  # the library's calls routed to cgraw's handle
        self._status = status  # the capture stream's capture status (2: invalidated); None: not checked
        self._get_stream = None

    def producer_streams(self) -> list[int]:
        return []

    def run(self, name: str, kinds: str, original, args: tuple):
        """A routed CuPy wrapper's call: on cgraw's handle when the capture stream is current."""
        if self._get_stream().ptr != self.stream_ptr:
            return original(*args)  # not the capture stream: CuPy's own path (eager, or its refusal)
        api = self.owner.API
        if len(args) != api.arity(kinds):
            raise api.not_covered(name, f"CuPy passed {len(args)} arguments where cgraw's table has "
                                        f"{api.arity(kinds)} (another CuPy version?)")
        return self.call(name, kinds, args[1:])

    def call(self, name: str, kinds: str, vals):
        """``name`` on cgraw's handle with ``vals`` (CuPy's arguments after the handle)."""
        api = self.owner.API
        cargs, outs = api.marshal(name, kinds, vals)
        fn = self.lib.function(name, kinds)
        self.calls += 1
        status = fn(self.handle, *cargs)
        if self._status is not None and self._status() == CAPTURE_INVALIDATED:
            raise api.not_covered(name, "it synchronised with the host inside the capture, which invalidated it"
                                  + self.invalidated_note(status))
        api.check(status, name)
        return int(outs[0].value) if outs else None  # a _bufferSize query's one output

    def invalidated_note(self, status: int) -> str:
        """What to add when a call invalidated the capture and returned ``status``."""
        return f" (it returned {self.owner.API.status_name(status)})" if status else ""

    def bind(self, handle: int) -> None:
        """The library's own set-up of cgraw's ``handle``, after it is bound to the capture stream."""

    def enter(self) -> None:
        cupy = sys.modules["cupy"]
        with cupy.cuda.Device(self.device):
            # made before the capture: creating it (cusolverDnCreate, cusparseCreate) allocates, which a
            # capture refuses
            self.cupy_handle = int(getattr(cupy.cuda.device, self.cupy_handle_getter)())
        self._get_stream = cupy.cuda.get_current_stream
        self.handle, _ = self.owner._routing.take_handle(self.device, self.lib.create)
        try:
            self.lib.set_stream(self.handle, self.stream_ptr)
            self.bind(self.handle)
            self.owner._routing.register(self, self.owner._install)
        except BaseException:
            self.owner._routing.unregister(self)
            try:
                self._release_handle()
            except Exception:  # the handle is leaked; the first error is the one to report
                pass
            raise

    def exit(self, failed: bool = False) -> None:
        self.owner._routing.unregister(self)
        self._release_handle()

    def _release_handle(self) -> None:
        h, self.handle = self.handle, None
        if h is not None:
            self.lib.set_stream(h, 0)
            self.owner._routing.put_back(self.device, h)  # if that failed, the handle is leaked instead


class CLibrary:
    """A C library through ctypes: entry points resolved once by name, set-up calls checked. With
    ``api`` (a ``CApi``), also its routines by name, ``create`` and ``set_stream``."""

    label = "?"  # the library's name in messages ("cuBLAS")
    statuses: dict[int, str] = {}
    api: CApi | None = None

    def __init__(self, dll, path: str = ""):
        self._dll, self.path, self._fns = dll, path, {}

    def _symbol(self, key, names, argtypes: list):
        """The first of ``names`` the library exports, with its prototype (None: none of them)."""
        fn = self._fns.get(key)
        if fn is None:
            fn = next((f for f in (getattr(self._dll, n, None) for n in names) if f is not None), None)
            if fn is not None:
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
                self._fns[key] = fn
        return fn

    def function(self, name: str, kinds: str):
        """Routine ``name`` with the prototype of its argument ``kinds``; ``not_covered`` if missing."""
        api = self.api
        fn = self._symbol(name, (api.symbol(name),), [ctypes.c_void_p, *(api.ctypes_of[k] for k in kinds)])
        if fn is None:
            raise api.not_covered(name, f"this {api.stem} ({self.path or '?'}) has no entry point for it")
        return fn

    def create(self) -> int:
        h, sym = ctypes.c_void_p(), self.api.symbol("create")
        self._setup(self._symbol("create", (sym,), [ctypes.POINTER(ctypes.c_void_p)]), sym, ctypes.byref(h))
        return int(h.value or 0)

    def set_stream(self, handle: int, stream: int) -> None:
        sym = self.api.symbol("setStream")
        self._setup(self._symbol("setStream", (sym,), [ctypes.c_void_p, ctypes.c_void_p]), sym, handle, stream)

    def _setup(self, fn, symbol: str, *args) -> None:
        """Call ``fn`` (``symbol``, None when missing), which sets cgraw's handle up."""
        status = -1 if fn is None else fn(*args)
        if status:
            prefix = self.label.upper()
            name = f"{prefix}_SYMBOL_MISSING" if fn is None else f"{prefix}_STATUS_{self.statuses.get(status, status)}"
            raise CaptureError(symbol, status, name,
                               f"setting up cgraw's {self.label} handle failed ({self.path or '?'})")


class Routing:
    """One library's routers, replaced CuPy functions and idle handles."""

    def __init__(self):
        self.lock = threading.Lock()
        self.routers: dict[int, object] = {}  # thread ident -> the router of its capture; written under lock
        self.patches: list = []  # (module, name, original, forwarder) while routers is non-empty; under lock
        self.idle: dict[int, list[int]] = {}  # device -> handles not in use (never destroyed); under lock

    def active(self):
        return self.routers.get(threading.get_ident())

    def register(self, router, install) -> None:
        """``router`` routes its thread's calls; the first one replaces CuPy's functions (``install()``)."""
        with self.lock:
            if not self.routers:
                try:
                    install()
                except BaseException:
                    self._uninstall()
                    raise
            self.routers[router.thread] = router

    def unregister(self, router) -> None:
        with self.lock:
            if self.routers.get(router.thread) is router:
                del self.routers[router.thread]
                if not self.routers:
                    self._uninstall()

    def patch(self, module, name: str, forwarder) -> None:
        """Replace ``module.name`` (called by ``install``, under the lock)."""
        self.patches.append((module, name, forwarder._cgraw_original, forwarder))
        setattr(module, name, forwarder)

    def _uninstall(self) -> None:
        while self.patches:
            module, name, original, forwarder = self.patches.pop()
            if getattr(module, name, None) is forwarder:  # someone else's replacement stays
                setattr(module, name, original)

    def take_handle(self, device: int, create) -> tuple[int, bool]:
        """An idle handle of ``device``, else ``create()``; and whether it is new."""
        with self.lock:
            if self.idle.get(device):
                return self.idle[device].pop(), False
        return create(), True

    def put_back(self, device: int, handle: int) -> None:
        with self.lock:
            self.idle.setdefault(device, []).append(handle)


def forwarder(routing: Routing, name: str, original, run):
    """``original`` that sends calls made with the thread's router's CuPy handle to ``run(router, args)``."""

    def forward(*args, **kwargs):
        r = routing.active()
        if r is None or kwargs or not args or args[0] != r.cupy_handle:
            return original(*args, **kwargs)
        return run(r, args)

    return named(forward, name, original)


def info_forwarder(routing: Routing, name: str, library_name: str, original):
    """``cupy.linalg._util``'s info check ``name``, refused (naming the call) while the thread's capture
    routes and ``cupyx.errstate(linalg=...)`` would make it wait for the GPU."""

    def check(routine, info, *rest):
        r = routing.active()
        if r is None or r._get_stream().ptr != r.stream_ptr or linalg_config() in ("ignore", None):
            return original(routine, info, *rest)
        routine_name = getattr(routine, "__name__", routine)
        raise CaptureError(
            f"cupy.linalg._util.{name}", 0, "LINALG_CHECK_NOT_COVERED",
            f"{entry_point()} checks {library_name}'s info of {routine_name} on the host because "
            "cupyx.errstate(linalg='raise') is in effect, which waits for the GPU; a capture cannot",
            "capture under linalg='ignore' (CuPy's default; eager CuPy does not check then either) and "
            "check the result outside the capture")

    return named(check, name, original)


def install_info_check(routing: Routing, name: str, library_name: str) -> None:
    try:
        util = importlib.import_module("cupy.linalg._util")
    except Exception:
        return
    fn = getattr(util, name, None)
    if callable(fn):
        routing.patch(util, name, info_forwarder(routing, name, library_name, fn))


def named(fn, name: str, original):
    fn.__name__, fn.__qualname__, fn.__doc__ = name, name, getattr(original, "__doc__", None)
    fn._cgraw_original = original
    return fn


def linalg_config() -> str | None:
    try:
        return importlib.import_module("cupyx._ufunc_config").get_config_linalg()
    except Exception:  # another CuPy: let its own check decide
        return None


def entry_point() -> str:
    """The outermost of the CuPy functions that called this one (the call the user made)."""
    entry, f = None, sys._getframe(1)
    while f is not None:
        mod = f.f_globals.get("__name__", "")
        if mod.startswith(("cupy.", "cupyx.")):
            entry = f"{mod}.{f.f_code.co_name}"
        elif entry is not None:
            break
        f = f.f_back
    return entry or "a CuPy function"


def arity_ok(fn, n: int) -> bool:
    code = getattr(fn, "__code__", None)  # Cython's binding functions have one; builtins do not
    return code is None or getattr(code, "co_argcount", n) == n

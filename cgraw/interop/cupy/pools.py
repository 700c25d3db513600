"""CuPy adapter: run CuPy on the capture stream with its allocations from a cgraw pool.

Layer L7: CuPy is only used when the user has imported it. Allocations go through
``cupy.cuda.using_allocator`` (thread-local) to ``DevicePool.cupy_allocator``; the capture stream
is made CuPy's current stream with ``cupy.cuda.Stream.from_external``. Both are undone after the
capture. Around a capture cgraw also:

- creates CuPy's cuBLAS handle first (``warm_cublas``), so a cuBLAS call cgraw does not route
  (``interop.cupy.blas`` routes CuPy's matrix products) meets CuPy's own refusal rather than a
  failed handle creation;
- remembers CuPy's legacy random states, and drops any made by a failed capture (cuRAND cannot
  be initialised during a capture, and CuPy would keep the broken generator);
- runs cuFFT plan creation and execution (``cupy.fft._fft._exec_fft``/``_exec_fftn``, wrapped once)
  in the relaxed capture mode on the capturing thread: cuFFT's plan set-up makes calls that
  thread-local and global captures refuse, and CuPy's own captures are relaxed by default;
- stages host-to-device uploads (``cupy.asarray`` of a NumPy array, constants uploaded by cupyx
  functions) through pinned blocks the graph owns (``interop.cupy.staging``): ``prepare``, before
  the capture begins, reserves the arena and wraps ``cupy._core.array``;
- assigns a scalar through a boolean mask (``a[mask] = 0``) with ``cupy.copyto(where=...)``
  instead of CuPy's host count of the mask (``interop.cupy.mask``, wrapped in ``prepare`` too).
"""

from __future__ import annotations

import contextlib
import sys
import warnings

from cgraw import _cuda
from cgraw.runtime import memory as _memory
from cgraw.interop.cupy import mask as _mask, staging as _staging

HOST_SYNC = (
    "host synchronisation is not capturable: .get(), .item(), cupy.asnumpy(), printing a device "
    "value and Stream.synchronize() wait for the GPU, which a graph cannot do; move them out of the "
    "captured region"
)
CUBLAS = (
    "CuPy refused a cuBLAS call cgraw does not route ('calling cuBLAS API during stream capture is currently "
    "unsupported'): cgraw runs CuPy's cuBLAS calls (@, matmul, dot, inner, tensordot, einsum, cupy.cublas) "
    "on its own handle only on the capture stream of the capturing thread, with CuPy's handle, for the "
    "functions it covers (not cupy.cublas.iamax/iamin); do this one outside the capture, or with torch "
    "inside it (torch.from_dlpack / cupy.from_dlpack are zero-copy)"
)
CUBLAS_FAILED = "a cuBLAS call failed inside the capture (CuPy's handle cannot be made in one: keep warm_cublas=True)"
CUSOLVER = (
    "CuPy refuses cuSOLVER calls during stream capture: cgraw routes CuPy's dense cuSOLVER calls (getrf/getrs, "
    "potrf/potrs and batched, geqrf/orgqr/ormqr, gesvdjBatched, syevjBatched) on the "
    "capture stream of the capturing thread, with CuPy's handle; this one it does not (batched qr, batched svd "
    "of matrices over 32, or CGRAW_CUPY_CUSOLVER=0): do it outside the captured region"
)
CUSPARSE = (
    "CuPy refuses cuSPARSE calls during stream capture: cgraw routes CuPy's sparse @ dense products (spMV, spMM), "
    "sparseToDense, csr2coo/coo2csr, the index sorts and csr2cscEx2 on the capture stream of the capturing thread, "
    "with CuPy's handle; this one it does not (or CGRAW_CUPY_CUSPARSE=0): do it outside the captured region"
)
RNG = (
    "cupy.random through cuRAND cannot be captured (cuRAND refuses stream capture; CuPy's legacy "
    "generator cannot be initialised inside one): cgraw draws cupy.random's covered functions itself "
    "unless the capture has random=False; otherwise draw the random array outside the capture and "
    "pass it in. CuPy's random state is left as it was before the capture"
)
UPLOAD = (
    "a host-to-device upload failed inside the capture: cgraw stages CuPy's uploads made through "
    "cupy.asarray / cupy.array / cupy.asanyarray (also the constants that cupyx functions such as "
    "ndimage.gaussian_filter upload each call) through pinned blocks the graph owns, only on the capture "
    "stream of the capturing thread and only for NumPy arrays, scalars and lists of them; other host copies "
    "(ndarray.set, assigning a NumPy array into a CuPy array) CuPy refuses in a capture: make the device "
    "array before the capture, or pass device weights to the function (ndimage.convolve / correlate1d)"
)


def external_stream(cupy, stream, dev: int):
    """CuPy's view of a cgraw stream: ``Stream.from_external`` (CuPy 14, via ``__cuda_stream__``),
    else the older ``ExternalStream``."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        try:
            return from_external(stream)
        except TypeError:
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(stream.ptr, dev)


def cupy_module():
    return sys.modules.get("cupy")


def _capturing() -> bool:
    return getattr(_memory.thread_state, "capturing", 0) > 0


@contextlib.contextmanager
def relaxed():
    """This thread in the relaxed capture mode for the block (calls a stricter capture refuses)."""
    prev = _cuda.thread_exchange_capture_mode(_cuda.CAPTURE_MODES["relaxed"])
    try:
        yield
    finally:
        _cuda.thread_exchange_capture_mode(prev)


def _relaxed_while_capturing(fn):
    """``fn`` run in the relaxed capture mode when this thread is in a cgraw capture."""

    def wrapper(*args, **kwargs):
        if not _capturing():
            return fn(*args, **kwargs)
        with relaxed():
            return fn(*args, **kwargs)

    wrapper._cgraw_wrapped = fn
    wrapper.__name__ = getattr(fn, "__name__", "wrapped")
    wrapper.__doc__ = getattr(fn, "__doc__", None)
    return wrapper


_fft_wrapped = False


def _wrap_fft() -> None:
    """Wrap cuFFT plan creation and execution once (see the module docstring)."""
    global _fft_wrapped
    if _fft_wrapped:
        return
    _fft_wrapped = True
    try:
        import importlib

        mod = importlib.import_module("cupy.fft._fft")
    except Exception:  # no cupy.fft: nothing to wrap
        return
    for name in ("_exec_fft", "_exec_fftn"):
        fn = getattr(mod, name, None)
        if fn is not None and not hasattr(fn, "_cgraw_wrapped"):
            setattr(mod, name, _relaxed_while_capturing(fn))


def _give_host_func_list(stream) -> None:
    """CuPy keeps the host functions enqueued on a capturing stream in ``_graph_host_funcargs``,
    a list only its own ``begin_capture`` creates: give cgraw's capture stream one, so
    ``launch_host_func`` works there too (its entries are kept alive by the graph)."""
    try:
        if getattr(stream, "_graph_host_funcargs", ()) is None:
            stream._graph_host_funcargs = []
    except (AttributeError, TypeError):  # another CuPy: launch_host_func fails as it would
        pass


def _clear_curand_error() -> None:
    """A cuRAND set-up refused by a capture leaves an error pending in cuRAND's runtime, which
    the next generation reports (CURAND_STATUS_PREEXISTING_FAILURE) and so clears: generate once
    here, into a throwaway buffer with a throwaway generator, so the user's next call works."""
    curand = sys.modules.get("cupy_backends.cuda.libs.curand")
    cupy = sys.modules.get("cupy")
    if curand is None or cupy is None:
        return
    try:
        gen = curand.createGenerator(curand.CURAND_RNG_PSEUDO_DEFAULT)
    except Exception:
        return
    try:
        buf = cupy.empty(4, dtype=cupy.float32)
        for _ in range(2):
            try:
                curand.generateUniform(gen, buf.data.ptr, 4)
                break
            except Exception:
                continue
    except Exception:
        pass
    finally:
        try:
            curand.destroyGenerator(gen)
        except Exception:
            pass


def _random_states(cupy) -> dict | None:
    gen = sys.modules.get("cupy.random._generator")
    states = getattr(gen, "_random_states", None)
    return states if isinstance(states, dict) else None


class CupyRouting:
    """Brackets a capture for CuPy: allocator hook, current stream, cuBLAS handle, random states."""

    def __init__(self, pool, stream, owners: list, *, warm_cublas: bool = True):
        self.cupy = sys.modules["cupy"]
        self.pool = pool
        self.stream = stream
        self.owners = owners
        self.warm_cublas = warm_cublas
        self._alloc_ctx = None
        self._stream_ctx = None
        self._random_before = None
        self._staging = None  # this capture's uploads (interop.cupy.staging.CaptureStaging)
        self._installed = False  # whether prepare() wrapped cupy._core.array
        self._masked = False  # whether prepare() wrapped cupy.ndarray.__setitem__ (interop.cupy.mask)
        # host functions CuPy enqueued during the capture and the staged uploads' blocks (the graph keeps them)
        self.keepalive: list = []

    def producer_streams(self) -> list[int]:
        return [int(self.cupy.cuda.get_current_stream().ptr)]

    def prepare(self) -> None:
        """Before the capture begins, while nothing is routed: the pinned staging (arena reserved,
        dead graphs' blocks reused, ``cupy._core.array`` wrapped)."""
        self._staging = _staging.prepare(self.pool.device.ordinal, self.stream)
        why = _staging.install(self.cupy)
        if why:
            self._staging.arena, self._staging.unavailable = None, why
        else:
            self._installed = True
        self._masked = not _mask.install(self.cupy)  # else: CuPy's own mask assignment (a host read)

    def unprepare(self, failed: bool = True) -> None:
        """Undo ``prepare`` (idempotent); the staged blocks go to the graph's keep-alive list."""
        staging, self._staging = self._staging, None
        _staging.leave()
        try:
            if staging is not None:
                holder = staging.finish(failed)
                if holder is not None:
                    self.keepalive.append(holder)
        finally:
            _mask.leave()
            if self._masked:
                self._masked = False
                _mask.uninstall()
            if self._installed:
                self._installed = False
                _staging.uninstall(self.cupy)

    def enter(self) -> None:
        cupy = self.cupy
        dev = self.pool.device.ordinal
        _wrap_fft()
        if self.warm_cublas:
            with cupy.cuda.Device(dev):
                cupy.cuda.device.get_cublas_handle()
        states = _random_states(cupy)
        self._random_before = None if states is None else dict(states)
        self._alloc_ctx = cupy.cuda.using_allocator(self.pool.cupy_allocator(self.owners))
        self._alloc_ctx.__enter__()
        try:
            self._stream_ctx = external_stream(cupy, self.stream, dev)
            _give_host_func_list(self._stream_ctx)
            self._stream_ctx.__enter__()
            if self._staging is not None:
                _staging.enter(self._staging)
            if self._masked:
                _mask.enter(self.stream.ptr)
        except BaseException:
            self.exit(failed=True)
            raise

    def exit(self, failed: bool = False) -> None:
        try:
            if self._stream_ctx is not None:
                self.keepalive = list(getattr(self._stream_ctx, "_graph_host_funcargs", None) or ())
                self._stream_ctx.__exit__(None, None, None)
        finally:
            self._stream_ctx = None
            self.unprepare(failed)
            try:
                if self._alloc_ctx is not None:
                    ctx, self._alloc_ctx = self._alloc_ctx, None
                    ctx.__exit__(None, None, None)
            finally:
                before, self._random_before = self._random_before, None
                states = _random_states(self.cupy)
                if failed and before is not None and states is not None:
                    touched = [k for k in states if states[k] is not before.get(k)]
                    for k in touched:
                        # made (or replaced) during the failed capture: cuRAND may have been left
                        # half-initialised; CuPy makes a new one on next use
                        if k in before:
                            states[k] = before[k]
                        else:
                            del states[k]
                if failed:
                    _clear_curand_error()  # a cuRAND set-up refused by the capture leaves an error pending

    @staticmethod
    def classify(exc: BaseException) -> str | None:
        msg = str(exc)
        mod = type(exc).__module__
        name = type(exc).__name__
        if name == "CaptureError" and getattr(exc, "name", "") == "UPLOAD_NOT_COVERED":
            return f"{exc.description}; {exc.hint}"
        if name == "CURANDError" or "cuRAND API during stream capture" in msg:
            return RNG
        if "cuBLAS API during stream capture" in msg:
            return CUBLAS + _library_call(exc, "cublas")
        if name == "CUBLASError" and mod.startswith("cupy"):
            return f"{CUBLAS_FAILED}: {msg}{_library_call(exc, 'cublas')}"
        if "cuSOLVER" in msg and isinstance(exc, NotImplementedError) or name == "CUSOLVERError":
            return CUSOLVER + _library_call(exc, "cusolver")
        if "cuSPARSE" in msg and isinstance(exc, NotImplementedError):
            return CUSPARSE + _library_call(exc, "cusparse")
        if _uploads(exc):
            return UPLOAD
        if ("cudaErrorStreamCapture" in msg or "operation not permitted when stream is capturing" in msg
                or "stream is capturing" in msg or "stream was capturing" in msg):
            return HOST_SYNC
        return None


def _library_call(exc: BaseException, lib: str) -> str:
    """`` [cupy.linalg._solve.solve -> cusolver.sgetrf]``: the outermost CuPy function in the
    traceback and the outermost frame of CuPy's wrapper module of ``lib`` (Cython frames carry
    their module's globals), or ``""``."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    entry = outermost_cupy_frame(frames)
    routine = None
    for frame in frames:
        if _module(frame).endswith(f".libs.{lib}") or f"{lib}.pyx" in frame.f_code.co_filename:
            routine = f"{lib}.{frame.f_code.co_name.rsplit('.', 1)[-1]}"
            break
    called = " -> ".join(x for x in (entry, routine) if x)
    return f" [{called}]" if called else ""


def _module(frame) -> str:
    g = frame.f_globals
    return g.get("__name__", "") if isinstance(g, dict) else ""


def outermost_cupy_frame(frames) -> str | None:
    """``module.function`` of the first CuPy/cupyx frame among ``frames`` (outermost first), or None."""
    for frame in frames:
        mod = _module(frame)
        if mod.startswith(("cupy.", "cupyx.")):
            return f"{mod}.{frame.f_code.co_name}"
    return None


# Frames of CuPy's host-to-device staging. CuPy is Cython: its frames are named by qualified name
# ("cupy.cuda.memory.MemoryPointer.copy_from_host_async"), so the names are matched as substrings.
_UPLOAD_FRAMES = ("copy_from_host", "hostAlloc", "alloc_pinned", "_array_default")


def _uploads(exc: BaseException) -> bool:
    """Whether the failure came from CuPy staging host data for a device array (pinned memory or
    a host-to-device copy): CuPy 14.2's refusal of a copy on a capturing stream, or such a frame
    anywhere in the exception's traceback."""
    if "H2D transfers are disallowed" in str(exc):
        return True
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if "pinned_memory" in code.co_filename or any(n in code.co_name for n in _UPLOAD_FRAMES):
            return True
        tb = tb.tb_next
    return False

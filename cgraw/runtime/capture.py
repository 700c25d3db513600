"""``cgraw.capture()``: record torch, CuPy or mixed code as a CUDA graph.

Layer L8 (public API): composes the pool, the capture stream, the framework adapters and
``Graph``. Capture goes through the driver (``cuStreamBeginCapture``/``cuStreamEndCapture``,
``cuGraphInstantiateWithParams``); torch's and CuPy's own graph APIs are never used.

Exit rules (after Warp's ScopedCapture): the capture always ends, a partial graph is destroyed, a
failed capture restores the pool; a failure that is the capture's (host sync, RNG, a library call
it cannot route) is one ``CaptureError`` chained to the original; a user's exception propagates.
"""

from __future__ import annotations

import logging
import threading
import time

from cgraw import _cuda
from cgraw._cuda import defer
from cgraw.rng import plan as rng, device as rng_device
from cgraw.runtime import stream as _stream_mod
from cgraw.runtime.device import Device
from cgraw.errors import CaptureError, UnsafeCallError
from cgraw.runtime.graph import Graph
from cgraw.interop.cupy import pools as _icupy
from cgraw.interop.cupy import blas as _cupy_blas, rng as _cupy_rng, solver as _cupy_solver, sparse as _cupy_sparse
from cgraw.interop.torch import pools as _itorch, rng as _torch_rng
from cgraw.runtime.memory import DevicePool, capture_guard_enter, capture_guard_exit

log = logging.getLogger("cgraw")

_MODES = ("global", "thread_local", "relaxed")
_tls = threading.local()


def capturing() -> bool:
    """Whether a ``cgraw.capture()`` (or a graph-tree recording) is running on this thread."""
    return getattr(_tls, "active", None) is not None


def active() -> "capture | None":
    """The ``cgraw.capture()`` (or graph-tree recording) running on this thread, or None."""
    return getattr(_tls, "active", None)


NESTING: list = []  # (begin, end) run as a capture begins and ends on a thread (trees: graphed calls run inline)


def _activate(cap) -> None:
    _tls.active = cap
    for hook in NESTING:
        hook[0]()


def _deactivate(cap) -> None:
    if getattr(_tls, "active", None) is cap:
        _tls.active = None
        for hook in NESTING:
            hook[1]()


class capture:
    """Context manager that records the work of its block into a ``Graph``.

    Example::

        with cgraw.capture() as g:
            y = torch.sin(x) * 2          # x: a tensor made before the capture
        g.replay()                        # y now holds sin(x) * 2 for the current x

    Args:
        pool: a ``DevicePool`` shared by several graphs (replay them in capture order, never
            concurrently); by default the graph's own, reserved while it and its outputs live.
        mode: ``"thread_local"`` (default), ``"global"`` or ``"relaxed"``: which unsafe calls of
            other threads invalidate the capture (CUDA stream-capture modes).
        device: the device to capture on; the current one by default.
        warmup: a callable run once on the capture stream, with the pool's routing, right before
            capture starts: put lazy first-use work there (cuBLAS handles, kernel caches).
        upload: upload the executable at instantiation so the first replay is fast.
        frameworks: which of ``"torch"`` and ``"cupy"`` to route; by default each one the
            process has imported.
        warm_cublas: run a tiny torch matmul and create CuPy's cuBLAS handle before capture, and
            warm up a new cuBLAS handle of cgraw's (CuPy's matrix products are routed to it).
        random: draw torch's and CuPy's random numbers with cgraw's kernels, fresh on every
            replay, following their generators (README "Random numbers"); ``False``: a draw fails it.
    """

    def __init__(self, *, pool: DevicePool | None = None, mode: str = "thread_local", device=None,
                 warmup=None, upload: bool = True, frameworks=None, warm_cublas: bool = True,
                 random: bool = True):
        if mode not in _MODES:
            raise ValueError(f"{mode=} must be one of {_MODES}")
        if pool is not None and not isinstance(pool, DevicePool):
            raise TypeError(f"pool must be a cgraw.DevicePool, not {type(pool).__name__}")
        if warmup is not None and not callable(warmup):
            raise TypeError("warmup must be a callable taking no arguments")
        self.pool = pool
        self.mode = mode
        self.device = device
        self.warmup = warmup
        self.upload = upload
        self.frameworks = frameworks
        self.warm_cublas = warm_cublas
        self.random = random
        self._rng: list = []  # the random-number routers (interop.torch.rng.TorchRng, interop.cupy.rng.CupyRng)
        self._tree = self._empty_cache = False  # a graph-tree recording (for_tree), torch's cache emptied first
        self._keep_sdpa = False  # leave F.scaled_dot_product_attention unpatched (for_tree of compiled code)
        self._route = "thread"
        self.graph: Graph | None = None
        self._adapters: list = []
        self._owners: list = []
        self._snapshot = None
        self._prev_ctx = None
        self._t0 = 0.0

    @classmethod
    def for_tree(cls, pool: DevicePool, device, *, warm_cublas: bool, route: str,
                 empty_cache: bool = False, compiled: bool = False) -> "capture":
        """A graph-tree recording (``cuda_backend``): cuBLAS workspaces are scratch inside the
        recording, and memory handed out is managed by the tree's checkpoints, not by the arrays'
        lifetimes. ``route``: ``"thread"`` routes this thread's allocations to the pool,
        ``"stream"`` those on the capture stream (a backward pass allocates on autograd's thread).
        ``empty_cache``: release torch's cached free memory first, as ``torch.cuda.graph`` does.
        ``compiled``: the function is torch.compile's, whose frames dynamo guards on the globals
        they call: ``F.scaled_dot_product_attention`` is left as it is (replacing it for the
        capture would make dynamo compile again inside it)."""
        if route not in ("thread", "stream"):
            raise ValueError(f"{route=} must be 'thread' or 'stream'")
        self = cls(pool=pool, device=device, warm_cublas=warm_cublas)
        self._tree, self._route, self._empty_cache = True, route, empty_cache
        self._keep_sdpa = compiled
        return self

    def __enter__(self) -> Graph:
        if getattr(_tls, "active", None) is not None:
            raise CaptureError("cuStreamBeginCapture", 0, "NESTED_CAPTURE",
                               "a cgraw.capture() is already running on this thread",
                               "end the outer capture first; nested captures are not supported")
        dev = self._device()
        _cuda.init()
        self._prev_ctx = _cuda.ctx_get_current()
        dev.set_current()
        _stream_mod.refresh()
        pool = self.pool if self.pool is not None else DevicePool(dev, name="graph")
        if pool.device is not dev:
            raise ValueError(f"pool is on device {pool.device.ordinal}, capture on device {dev.ordinal}")
        stream = pool.capture_stream
        self.graph = Graph._pending(dev, pool, stream)
        self._adapters = self._make_adapters(pool, stream)
        self._rng = self._rng_routers(dev.ordinal, stream) if self.random and self._adapters else []
        self._adapters += [rng_device.RngAdapter(r) for r in self._rng]

        # Work queued before the capture (inputs being written) must finish before the graph's
        # first node: the capture stream waits on the legacy stream and the frameworks' current streams.
        for ptr in {0, *(p for a in self._adapters for p in a.producer_streams())}:
            if ptr != stream.ptr:
                stream.wait(event_on(dev, ptr))
        prepared = self._prepare_adapters()
        self._snapshot = pool.snapshot()
        entered = []
        # from here until __exit__ has left the routing, nothing is freed (cgraw._cuda.defer)
        defer.capture_begins()
        try:
            defer.gc_stress()
            for a in self._adapters:
                a.enter()
                entered.append(a)
            if self.warmup is not None:
                self.warmup()
            capture_guard_enter()
            try:
                _cuda.stream_begin_capture(stream.handle, _cuda.CAPTURE_MODES[self.mode])
                _activate(self)
                self._t0 = time.perf_counter()
                defer.gc_stress()
            except BaseException:
                # an interrupt may land after the capture began: never leave the stream capturing
                _deactivate(self)
                _end_quietly(stream)
                capture_guard_exit()
                raise
        except BaseException:
            try:
                for a in reversed(entered):
                    a.exit(failed=True)
                for a in prepared:
                    if a not in entered:
                        a.unprepare()
                self._restore_pool()
            finally:
                defer.capture_ends()
                self._restore_context()
            raise
        return self.graph

    def __exit__(self, exc_type, exc, tb):
        graph = self.graph
        stream = graph.capture_stream
        _deactivate(self)
        try:
            defer.gc_stress()
        except BaseException:  # a finalizer run by the stress collection must not skip the end
            pass
        status, capture_id = 0, 0
        try:
            status, capture_id = _cuda.stream_capture_info(stream.handle)
        except Exception:
            pass
        unjoined: list[int] = []
        if status == 1 and exc_type is None and _has_unjoined_work(stream):
            # name the culprits while they are still capturing (EndCapture takes them out)
            unjoined = _itorch.side_streams(capture_id, stream.ptr, _cuda.stream_capture_info)
        rng_error = None
        drawn = [r for r in self._rng if r.stream.calls]
        if drawn and status == 1 and exc_type is None:
            try:  # the graph's last nodes: the next replay draws fresh numbers
                for r in drawn:
                    rng_device.advance(r.stream, stream.handle)
            except BaseException as e:
                rng_error = e
        err, cugraph = _cuda.stream_end_capture_raw(stream.handle)
        capture_guard_exit()
        capture_ms = (time.perf_counter() - self._t0) * 1e3
        failed = exc_type is not None or bool(err) or rng_error is not None
        exit_error = rng_error
        host_funcs = []
        try:
            for a in reversed(self._adapters):
                try:
                    a.exit(failed=failed)
                    host_funcs.extend(getattr(a, "keepalive", ()))
                except BaseException as e:  # keep unwinding the others
                    exit_error = exit_error or e
        finally:
            self._adapters = []
            defer.capture_ends()
            self._restore_context()
        host_funcs.extend(stream.take_host_funcs())

        if exc_type is not None or err or exit_error is not None:
            if cugraph is not None:
                _cuda.destroy_quietly("graph", cugraph)
            self._restore_pool()
            graph.close()
            if exc_type is not None:
                message = self._classify(exc, err, status)
                if message is None:
                    return False  # the user's own exception, unchanged
                where = _itorch.user_frame(exc)
                if where is not None and where[2]:
                    message += f" [at {where[0]}:{where[1]}: {where[2]}]"
                raise CaptureError("cuStreamEndCapture", int(err), _err_name(err), message) from exc
            if err:
                raise self._end_error(err, unjoined)
            raise exit_error

        graph.capture_ms = capture_ms
        t0 = time.perf_counter()
        try:
            graph._finish(cugraph, upload=self.upload)
            if drawn:  # what its replays do with the generators it draws from
                graph._set_rng(rng.GraphRng(r.use() for r in drawn))
        except BaseException:
            graph.close()
            self._restore_pool()  # instantiation failed: as after any failed capture
            raise
        graph._keepalive.extend(host_funcs)
        graph.instantiate_ms = (time.perf_counter() - t0) * 1e3
        if self._tree:
            self._disown()
        self._owners = []
        log.debug("cgraw: captured %d nodes in %.2f ms, instantiated in %.2f ms",
                  graph.num_nodes, capture_ms, graph.instantiate_ms)
        return False

    # ------------------------------------------------------------------ helpers

    def random_streams(self) -> list:
        """The ``rng.plan.RngStream`` of each framework whose random numbers this capture routes
        (``cgraw.control`` ends a loop body that draws with a step of their keys)."""
        return [r.stream for r in self._rng]

    def _device(self) -> Device:
        if self.device is None:
            if self.pool is not None:
                return self.pool.device
            return Device.current()
        return self.device if isinstance(self.device, Device) else Device(int(self.device))

    def _make_adapters(self, pool, stream) -> list:
        wanted = self.frameworks
        out = []
        if (wanted is None and _itorch.torch_module() is not None) or (wanted is not None and "torch" in wanted):
            if _itorch.torch_module() is None:
                raise ImportError("frameworks=('torch',) but torch is not imported")
            out.append(_itorch.TorchRouting(pool, stream, warm_cublas=self.warm_cublas,
                                            clear_workspaces=self._tree, route=self._route,
                                            empty_cache=self._empty_cache))
        if (wanted is None and _icupy.cupy_module() is not None) or (wanted is not None and "cupy" in wanted):
            if _icupy.cupy_module() is None:
                raise ImportError("frameworks=('cupy',) but cupy is not imported")
            out.append(_icupy.CupyRouting(pool, stream, self._owners, warm_cublas=self.warm_cublas))
            # after CuPy's routing (they need it)
            routers = (_cupy_blas.router(pool, stream, warm=self.warm_cublas), _cupy_solver.router(pool, stream),
                       _cupy_sparse.router(pool, stream))
            out.extend(r for r in routers if r is not None)
        return out

    def _prepare_adapters(self) -> list:
        """Run each adapter's ``prepare`` (work that must happen while no capture routes
        allocations, before this one is counted in); on failure undo those that ran."""
        prepared = []
        try:
            for a in self._adapters:
                prep = getattr(a, "prepare", None)
                if prep is not None:
                    prep()
                    prepared.append(a)
        except BaseException:
            for a in reversed(prepared):
                a.unprepare()
            self._adapters = []
            self._restore_context()
            raise
        return prepared

    def _rng_routers(self, device: int, stream) -> list:
        """The random-number routers of the frameworks being routed (entered after them), each
        drawing for its framework's generator record of this thread on ``device`` (made, on first
        use, before the capture begins)."""
        out = []
        for a in self._adapters:
            for cls, mod, kind in ((_itorch.TorchRouting, _torch_rng, rng.TORCH),
                                   (_icupy.CupyRouting, _cupy_rng, rng.CUPY)):
                if isinstance(a, cls):
                    thread = threading.get_ident()
                    src = rng_device.source(device, kind, stream.handle, thread)
                    r = mod.router(rng.RngStream(src.slot, device, thread, kind), src)
                    if kind == rng.TORCH:
                        r.patch_sdpa = not self._keep_sdpa
                    out.append(r)
        return out

    def _restore_context(self) -> None:
        """Make the context that was current before the capture current again (a capture on
        another device must not leave that device's context current on this thread)."""
        prev, self._prev_ctx = self._prev_ctx, None
        if prev is not None and _cuda.native(prev) != 0:
            try:
                _cuda.ctx_set_current(prev)
            except Exception:  # the previous context is gone: leave the capture's current
                pass

    def _disown(self) -> None:
        """Blocks the capture handed to CuPy arrays stop freeing themselves: the pool's
        checkpoints (a tree) or the restore after a failed capture own them now."""
        for r in self._owners:
            owner = r()
            if owner is not None:
                owner.disown()
        self._owners = []

    def _restore_pool(self) -> None:
        """Put the pool back as it was before the capture; blocks handed out since are disowned."""
        pool = self.graph.pool
        if self._snapshot is None or pool.closed:
            return
        self._disown()
        pool.restore(self._snapshot)

    def _classify(self, exc, err, status) -> str | None:
        """The plain-words reason a capture failed, or None for the user's own exception."""
        if isinstance(exc, CaptureError) and exc.name.endswith("_NOT_COVERED"):  # names the op itself
            return f"{exc.description}; {exc.hint}"
        for e in _chain(exc):
            cupy_first = type(e).__module__.startswith("cupy")
            for cls in ((_icupy.CupyRouting, _itorch.TorchRouting) if cupy_first
                        else (_itorch.TorchRouting, _icupy.CupyRouting)):
                msg = cls.classify(e)
                if msg is not None:
                    return msg
        if isinstance(exc, UnsafeCallError):
            return str(exc)
        if isinstance(exc, CaptureError) or (isinstance(exc, _cuda.CudaError) and exc.code in _cuda.CAPTURE_CODES):
            return f"the capture failed: {exc}"
        if status == 2 or err == _cuda.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                return None
            if isinstance(exc, RuntimeError) and "cuda" in str(exc).lower():
                return f"the capture was invalidated by an operation that cannot be captured: {exc}"
        return None

    @staticmethod
    def _end_error(err, unjoined: list[int]) -> CaptureError:
        e = _cuda.make_error(err, "cuStreamEndCapture")
        if err == _cuda.CUresult.CUDA_ERROR_STREAM_CAPTURE_UNJOINED:
            names = ", ".join(f"0x{p:x}" for p in unjoined) or "(a stream cgraw could not identify)"
            return CaptureError(e.call, e.code, e.name,
                                f"side stream(s) {names} forked into the capture were not joined back",
                                "make the capture stream wait on each side stream (an event, or "
                                "torch.cuda.current_stream().wait_stream(side)) before the block ends")
        return e if isinstance(e, CaptureError) else CaptureError(e.call, e.code, e.name, e.description, e.hint)


def _has_unjoined_work(stream) -> bool:
    """True if the graph being captured has a leaf node the origin stream does not depend on,
    i.e. work forked to a side stream that was never joined back."""
    try:
        graph, deps = _cuda.stream_capture_graph(stream.handle)
        return _cuda.has_leaf_outside(_cuda.graph_get_nodes(graph), _cuda.graph_get_edges(graph), deps)
    except Exception:  # diagnosis only: never let it break the capture's exit
        return False


def _chain(exc):
    """An exception and the ones it was raised from (cause or context), outermost first."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _end_quietly(stream) -> None:
    """End a capture that ``__enter__`` could not hand over; never raises."""
    try:
        if stream.capture_status != 0:
            err, cugraph = _cuda.stream_end_capture_raw(stream.handle)
            if cugraph is not None:
                _cuda.destroy_quietly("graph", cugraph)
    except Exception:
        pass


def event_on(dev: Device, stream_ptr: int):
    """A new event on ``dev``, recorded on the stream ``stream_ptr``."""
    from cgraw.runtime.stream import Event

    ev = Event.create(dev)
    _cuda.event_record(ev.handle, _cuda.stream_handle(stream_ptr))
    return ev


def _err_name(err) -> str:
    try:
        return _cuda.CUresult(int(err)).name
    except ValueError:  # not a driver result
        return str(err)

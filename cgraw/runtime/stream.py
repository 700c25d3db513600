"""Streams and events, and which stream is the caller's current one.

Layer L3: imports ``_cuda``, ``device`` and ``interop.torch.private_api`` (layer 1). A ``Stream`` is owned
(created and destroyed by cgraw) or borrowed from an int handle, a torch stream, a CuPy stream or
any object with ``__cuda_stream__``; a borrowed stream keeps its donor alive and is never
destroyed by cgraw.

The current stream (where ``Graph.replay()`` and graphed calls run, as torch's own graphs do):
torch's current stream for the device if torch is imported and that stream is not the default
one; otherwise CuPy's current stream if CuPy is imported; otherwise the legacy default stream.
So ``with torch.cuda.stream(s):`` and ``with cupy.cuda.Stream():`` both work, and when both set
one, torch's wins. ``current_ptr`` calls torch's raw getter and CuPy's Cython one, nothing else.
"""

from __future__ import annotations

import ctypes
import operator
import sys
import weakref

from cgraw import _cuda
from cgraw.runtime.device import Device
from cgraw.interop.torch import private_api


class Stream:
    """A CUDA stream. Build one with ``Stream.create()`` or ``Stream.of(obj)``."""

    __slots__ = ("handle", "ptr", "device", "is_owned", "_owner", "_finalizer", "_host_funcs", "__weakref__")

    def __init__(self, *args, **kwargs):
        raise TypeError("use Stream.create(), Stream.from_handle() or Stream.of()")

    @classmethod
    def _make(cls, handle, device: Device, is_owned: bool, owner=None) -> "Stream":
        self = object.__new__(cls)
        self.handle = handle
        self.ptr = _cuda.native(handle)
        self.device = device
        self.is_owned = is_owned
        self._owner = owner
        self._host_funcs = []  # host functions enqueued while capturing: the graph adopts them
        if is_owned:
            self._finalizer = weakref.finalize(
                self, _cuda.destroy_quietly, "stream", handle
            )
        else:
            self._finalizer = None
        return self

    @classmethod
    def create(cls, device: Device | int | None = None, *, non_blocking: bool = True) -> "Stream":
        """Create an owned stream (non-blocking by default, so legacy-stream work never joins it)."""
        dev = _as_device(device)
        dev.set_current()
        flags = _cuda.STREAM_NON_BLOCKING if non_blocking else 0
        return cls._make(_cuda.stream_create(flags), dev, True)

    @classmethod
    def from_handle(cls, ptr: int, device: Device | int | None = None, *, owner=None) -> "Stream":
        """Borrow a raw stream handle; ``owner`` is kept alive as long as this object."""
        if not isinstance(ptr, int) or ptr < 0:
            raise ValueError(f"{ptr=} must be a non-negative int stream handle")
        return cls._make(_cuda.stream_handle(ptr), _as_device(device), False, owner)

    @classmethod
    def of(cls, obj, device: Device | int | None = None) -> "Stream":
        """Borrow any stream-like object: Stream, int, torch/CuPy stream, ``__cuda_stream__``."""
        if isinstance(obj, Stream):
            return obj
        if isinstance(obj, int):
            return cls.from_handle(obj, device)
        proto = getattr(obj, "__cuda_stream__", None)
        if proto is not None:
            _, ptr = proto() if callable(proto) else proto
            return cls.from_handle(int(ptr), device, owner=obj)
        ptr = getattr(obj, "cuda_stream", None)  # torch.cuda.Stream / ExternalStream
        if ptr is None:
            ptr = getattr(obj, "ptr", None)  # cupy.cuda.Stream
        if ptr is None:
            raise TypeError(f"cannot use {type(obj).__name__} as a CUDA stream")
        if device is None:
            dev = getattr(obj, "device", None)
            device = getattr(dev, "index", None) if dev is not None else getattr(obj, "device_id", None)
            if isinstance(dev, int):
                device = dev
        return cls.from_handle(int(ptr), device, owner=obj)

    def __cuda_stream__(self):
        return (0, self.ptr)

    def synchronize(self) -> None:
        """Wait until all work submitted to the stream is done."""
        _cuda.stream_synchronize(self.handle)

    def launch_host_func(self, callback, arg) -> None:
        """Call ``callback(arg)`` on the host once the work queued so far is done, as CuPy's
        ``Stream.launch_host_func`` does. Inside a capture it becomes a host node: every replay
        calls it. The callback must not call CUDA; an exception it raises is logged."""
        capturing = self.capture_status == 1
        done = [False]

        def run(_user_data, _cb=callback, _arg=arg):
            try:
                _cb(_arg)
            except BaseException:  # a host node cannot raise into CUDA
                import logging

                logging.getLogger("cgraw").exception("cgraw: host function %r raised", _cb)
            done[0] = True  # never free a callback while it runs: pruned at a later launch

        cfunc = _HOST_FN(run)
        if capturing:
            self._host_funcs.append(cfunc)  # kept alive by the graph being captured
        else:
            _ONE_SHOT[:] = [e for e in _ONE_SHOT if not e[1][0]]
            _ONE_SHOT.append((cfunc, done))  # kept alive until it has run
        _cuda.launch_host_func(self.ptr, ctypes.cast(cfunc, ctypes.c_void_p).value)

    def take_host_funcs(self) -> list:
        """Hand over (and forget) the host functions enqueued during a capture."""
        out, self._host_funcs = self._host_funcs, []
        return out

    def query(self) -> bool:
        """True once all work submitted to the stream has completed."""
        return _cuda.stream_query(self.handle)

    def record(self, event: "Event | None" = None) -> "Event":
        """Record ``event`` (a new one if None) on this stream and return it."""
        if event is None:
            event = Event.create(self.device)
        _cuda.event_record(event.handle, self.handle)
        return event

    def wait(self, other: "Event | Stream") -> None:
        """Make later work on this stream wait for ``other`` (an event, or a stream's current work)."""
        if isinstance(other, Stream):
            other = other.record()
        _cuda.stream_wait_event(self.handle, other.handle)

    def copy_dtod(self, dst: int, src: int, nbytes: int) -> None:
        """Queue a device-to-device copy of ``nbytes`` (in a capture: a memcpy node)."""
        _cuda.memcpy_dtod_async(dst, src, nbytes, self.handle)

    @property
    def capture_status(self) -> int:
        """0 = not capturing, 1 = capturing, 2 = capture invalidated."""
        return _cuda.stream_is_capturing(self.handle)

    @property
    def is_capturing(self) -> bool:
        """True while a stream capture is under way on this stream (active or invalidated)."""
        return self.capture_status != 0

    def close(self) -> None:
        """Destroy an owned stream (idempotent); a no-op for borrowed streams."""
        if self._finalizer is not None:
            self._finalizer()

    def __eq__(self, other):
        return isinstance(other, Stream) and other.ptr == self.ptr

    def __hash__(self):
        return hash(self.ptr)

    def __repr__(self) -> str:
        kind = "owned" if self.is_owned else "borrowed"
        return f"<cgraw.Stream 0x{self.ptr:x} {kind} on device {self.device.ordinal}>"


_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_ONE_SHOT: list = []  # (host function, [done]) enqueued outside captures, until they have run


class Event:
    """A CUDA event (timing disabled unless ``timing=True``)."""

    __slots__ = ("handle", "device", "_finalizer", "__weakref__")

    def __init__(self, *args, **kwargs):
        raise TypeError("use Event.create()")

    @classmethod
    def create(cls, device: Device | int | None = None, *, timing: bool = False) -> "Event":
        """Create an event on ``device`` (the current one if None); ``timing=True`` lets it measure
        ``elapsed_ms`` (timing events cost more to record)."""
        dev = _as_device(device)
        dev.set_current()
        self = object.__new__(cls)
        self.device = dev
        self.handle = _cuda.event_create(_cuda.EVENT_DEFAULT if timing else _cuda.EVENT_DISABLE_TIMING)
        self._finalizer = weakref.finalize(
            self, _cuda.destroy_quietly, "event", self.handle
        )
        return self

    def record(self, stream: Stream) -> "Event":
        """Record the event on ``stream`` (it completes once the work queued there so far is done); returns it."""
        _cuda.event_record(self.handle, stream.handle)
        return self

    def query(self) -> bool:
        """True once the work before the event's last record has completed."""
        return _cuda.event_query(self.handle)

    def synchronize(self) -> None:
        """Wait until the event has completed."""
        _cuda.event_synchronize(self.handle)

    def elapsed_ms(self, end: "Event") -> float:
        """Milliseconds from this event to ``end`` (both created with ``timing=True``)."""
        return _cuda.event_elapsed_time(self.handle, end.handle)

    def close(self) -> None:
        """Destroy the event (idempotent)."""
        self._finalizer()


def _as_device(device) -> Device:
    if device is None:
        return Device.current()
    if isinstance(device, Device):
        return device
    return Device(int(device))


# ---------------------------------------------------------------------- the caller's stream


def _no_framework(ordinal: int) -> int:
    if "torch" in sys.modules or "cupy" in sys.modules:
        return refresh()(ordinal)
    return 0


# The caller's current stream handle for a device ordinal. Rebound by refresh() once a framework is
# imported: read it as ``stream.current_getter`` at each call, never ``from cgraw.runtime.stream import``.
current_getter = _no_framework


def refresh():
    """Bind ``current_getter`` to the frameworks imported now (captures and trees call this)."""
    global current_getter
    tget = private_api.api()._cuda_getCurrentRawStream if "torch" in sys.modules else None
    cget = None
    if "cupy" in sys.modules:
        mod = sys.modules.get("cupy_backends.cuda.stream")
        cget = getattr(mod, "get_current_stream_ptr", None)
        if cget is None:  # older CuPy: the public, slower getter
            get_current = sys.modules["cupy"].cuda.get_current_stream

            def cget():
                return get_current().ptr
    if tget is not None and cget is not None:
        def cur(ordinal: int) -> int:
            return tget(ordinal) or cget()
    elif tget is not None:
        cur = tget  # torch's own C function: no Python frame on a replay
    elif cget is not None:
        def cur(ordinal: int) -> int:
            return cget()
    else:
        cur = _no_framework
    current_getter = cur
    return cur


def current_ptr(ordinal: int) -> int:
    """The raw handle of the caller's current stream for device ``ordinal`` (0: legacy)."""
    return current_getter(ordinal)


_getters: dict = {}  # type -> how to read a raw handle from a stream object of that type


def stream_ptr(obj) -> int:
    """The raw handle of any stream-like object (int, Stream, torch/CuPy stream, ``__cuda_stream__``);
    how to read it is worked out once per type."""
    t = type(obj)
    get = _getters.get(t)
    if get is None:
        get = _getters[t] = _getter_for(obj)
    return get(obj)


def _getter_for(obj):
    if isinstance(obj, int):
        return int
    if isinstance(obj, Stream):
        return operator.attrgetter("ptr")
    if hasattr(obj, "cuda_stream"):  # torch.cuda.Stream / ExternalStream
        return operator.attrgetter("cuda_stream")
    if type(obj).__module__.startswith("cupy") and hasattr(obj, "ptr"):  # cupy.cuda.Stream
        return operator.attrgetter("ptr")
    if hasattr(obj, "__cuda_stream__"):
        def proto(o):
            p = o.__cuda_stream__
            return int((p() if callable(p) else p)[1])
        return proto
    raise TypeError(f"cannot use {type(obj).__name__} as a CUDA stream")

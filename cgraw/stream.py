"""Streams and events.

Layer L1: imports ``_cuda`` and ``device``. A ``Stream`` is owned (created and destroyed by
cgraw) or borrowed from an int handle, a torch stream, a CuPy stream or any object with
``__cuda_stream__``; a borrowed stream keeps its donor alive and is never destroyed by cgraw.
"""

from __future__ import annotations

import weakref

from cgraw import _cuda
from cgraw.device import Device


class Stream:
    """A CUDA stream. Build one with ``Stream.create()`` or ``Stream.of(obj)``."""

    __slots__ = ("handle", "ptr", "device", "is_owned", "_owner", "_finalizer", "__weakref__")

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
        if is_owned:
            self._finalizer = weakref.finalize(
                self, _cuda.destroy_quietly, _cuda.drv.cuStreamDestroy, handle, "stream"
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
        return cls._make(_cuda.drv.CUstream(ptr), _as_device(device), False, owner)

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
        _cuda.stream_synchronize(self.handle)

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

    @property
    def capture_status(self) -> int:
        """0 = not capturing, 1 = capturing, 2 = capture invalidated."""
        return _cuda.stream_is_capturing(self.handle)

    @property
    def is_capturing(self) -> bool:
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


class Event:
    """A CUDA event (timing disabled unless ``timing=True``)."""

    __slots__ = ("handle", "device", "_finalizer", "__weakref__")

    def __init__(self, *args, **kwargs):
        raise TypeError("use Event.create()")

    @classmethod
    def create(cls, device: Device | int | None = None, *, timing: bool = False) -> "Event":
        dev = _as_device(device)
        dev.set_current()
        self = object.__new__(cls)
        self.device = dev
        self.handle = _cuda.event_create(_cuda.EVENT_DEFAULT if timing else _cuda.EVENT_DISABLE_TIMING)
        self._finalizer = weakref.finalize(
            self, _cuda.destroy_quietly, _cuda.drv.cuEventDestroy, self.handle, "event"
        )
        return self

    def record(self, stream: Stream) -> "Event":
        _cuda.event_record(self.handle, stream.handle)
        return self

    def query(self) -> bool:
        return _cuda.event_query(self.handle)

    def synchronize(self) -> None:
        _cuda.event_synchronize(self.handle)

    def elapsed_ms(self, end: "Event") -> float:
        """Milliseconds from this event to ``end`` (both created with ``timing=True``)."""
        return _cuda.event_elapsed_time(self.handle, end.handle)

    def close(self) -> None:
        self._finalizer()


def _as_device(device) -> Device:
    if device is None:
        return Device.current()
    if isinstance(device, Device):
        return device
    return Device(int(device))

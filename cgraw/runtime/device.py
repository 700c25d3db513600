"""Devices and their primary contexts.

Layer L2: imports ``_cuda`` only. A ``Device`` is a per-ordinal singleton that retains the
device's primary context on first use (the same context torch and CuPy use), so handles
interchange freely between the three.
"""

from __future__ import annotations

import threading

from cgraw import _cuda

_lock = threading.Lock()
_devices: dict[int, "Device"] = {}  # guarded by _lock


class Device:
    """A CUDA device; ``Device(n)`` returns the same object for the same ordinal."""

    __slots__ = ("ordinal", "_handle", "_ctx", "__weakref__")

    def __new__(cls, ordinal: int = 0):
        if not isinstance(ordinal, int) or isinstance(ordinal, bool) or ordinal < 0:
            raise ValueError(f"{ordinal=} must be a non-negative int")
        dev = _devices.get(ordinal)
        if dev is not None:
            return dev
        with _lock:
            dev = _devices.get(ordinal)
            if dev is None:
                dev = object.__new__(cls)
                dev.ordinal = ordinal
                dev._handle = None
                dev._ctx = None
                _devices[ordinal] = dev
        return dev

    @staticmethod
    def count() -> int:
        """Number of visible CUDA devices (raises ``CudaUnavailableError`` without a driver)."""
        return _cuda.device_get_count()

    @classmethod
    def current(cls) -> "Device":
        """The device of the context current on this thread, or device 0 if none is."""
        _cuda.init()
        ctx = _cuda.ctx_get_current()
        if ctx is None or _cuda.native(ctx) == 0:
            return cls(0)
        return cls(_cuda.ctx_get_device())

    @property
    def handle(self):
        """The driver ``CUdevice``."""
        if self._handle is None:
            n = _cuda.device_get_count()
            if self.ordinal >= n:
                raise ValueError(f"device {self.ordinal} does not exist: {n} CUDA device(s) visible")
            self._handle = _cuda.device_get(self.ordinal)
        return self._handle

    @property
    def context(self):
        """The retained primary context (retained once, for the life of the process)."""
        if self._ctx is None:
            with _lock:
                if self._ctx is None:
                    self._ctx = _cuda.device_primary_ctx_retain(self.handle)
        return self._ctx

    def set_current(self) -> "Device":
        """Make this device's primary context current on the calling thread."""
        _cuda.ctx_set_current(self.context)
        return self

    @property
    def name(self) -> str:
        """The device's name as the driver reports it (``cuDeviceGetName``), e.g. "NVIDIA H200"."""
        return _cuda.device_get_name(self.handle)

    def synchronize(self) -> None:
        """Wait until all work on this device is done (``cuCtxSynchronize`` in its primary context)."""
        self.set_current()
        _cuda.ctx_synchronize()

    def mem_get_info(self) -> tuple[int, int]:
        """``(free, total)`` device bytes as the driver reports them."""
        self.set_current()
        return _cuda.mem_get_info()

    def __repr__(self) -> str:
        return f"<cgraw.Device {self.ordinal}>"

    def __reduce__(self):
        return (Device, (self.ordinal,))

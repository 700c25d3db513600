"""``cgraw.Tensor``: a typed, strided view of device memory that torch and CuPy consume zero-copy.

Layer L5: imports ``_cuda``, ``device``, ``stream``, ``memory``, ``dlpack`` and
``dlpack.capsules``; no framework imports. A Tensor exports DLPack 1.x capsules (versioned or
legacy, as the consumer asks) and ``__cuda_array_interface__`` v3. Exports honour the consumer's
stream: it waits on the stream the tensor was last written on. Every export holds the tensor's
memory until the consumer's deleter runs, and the owning pool can report which blocks consumers
still hold.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from cgraw import _cuda
from cgraw.dlpack import structs as dlpack, capsules
from cgraw.runtime.device import Device
from cgraw.errors import CgrawError
from cgraw.runtime.memory import free_quietly
from cgraw.runtime.stream import Stream

_tls = threading.local()


def _sync_event(device: Device):
    """A per-thread, per-device event used to order a consumer after a producer."""
    evs = getattr(_tls, "events", None)
    if evs is None:
        evs = _tls.events = {}
    ev = evs.get(device.ordinal)
    if ev is None:
        from cgraw.runtime.stream import Event

        ev = evs[device.ordinal] = Event.create(device)
    return ev


class _Memory:
    """Owns a pool block (or another object's memory) and counts consumer exports.

    The block goes back to its pool when the last Tensor and the last DLPack consumer let go.
    """

    __slots__ = ("pool", "ptr", "nbytes", "stream_id", "base", "exports", "__weakref__")

    def __init__(self, pool, ptr: int, nbytes: int, stream_id: int = 0, base=None):
        self.pool = pool
        self.ptr = ptr
        self.nbytes = nbytes
        self.stream_id = stream_id
        self.base = base  # an imported producer kept alive (DLPackView), or None
        self.exports = 0

    def release_export(self) -> None:
        self.exports -= 1
        holds = getattr(self.pool, "consumer_holds", None)
        if holds is not None:
            n = holds.get(self.ptr, 0) - 1
            if n > 0:
                holds[self.ptr] = n
            else:
                holds.pop(self.ptr, None)

    def add_export(self) -> None:
        self.exports += 1
        holds = getattr(self.pool, "consumer_holds", None)
        if holds is not None:
            holds[self.ptr] = holds.get(self.ptr, 0) + 1

    def __del__(self):
        if self.pool is not None:
            free_quietly(self.pool, self.ptr, self.stream_id)


class Tensor:
    """A typed, strided view of device memory.

    Attributes:
        ptr: address of element 0.
        shape, strides: tuples; strides are in elements.
        dtype: a numpy dtype, or the string ``"bfloat16"``.
        device: the ``cgraw.Device``.
        stream: the ``Stream`` its contents were last written on (None: the legacy stream).
    """

    __slots__ = ("ptr", "shape", "strides", "dtype", "itemsize", "device", "stream", "readonly", "_mem",
                 "__weakref__")

    def __init__(self, *args, **kwargs):
        raise TypeError("use cgraw.Tensor.empty(), Tensor.from_ptr() or cgraw.from_dlpack()")

    @classmethod
    def _make(cls, ptr, shape, strides, dtype, device, mem, stream=None, readonly=False) -> "Tensor":
        self = object.__new__(cls)
        self.ptr = ptr
        self.shape = shape
        self.strides = strides
        self.dtype = dtype
        code, bits, lanes = dlpack.to_dl_dtype(dtype)
        self.itemsize = bits * lanes // 8
        self.device = device
        self.stream = stream
        self.readonly = readonly
        self._mem = mem
        return self

    @classmethod
    def empty(cls, shape, dtype, *, pool, stream=None) -> "Tensor":
        """A new C-contiguous tensor whose memory is a block of ``pool``."""
        shape = _shape(shape)
        dtype = _dtype(dtype)
        _, bits, lanes = dlpack.to_dl_dtype(dtype)
        nbytes = max(math.prod(shape) * bits * lanes // 8, 1)
        s = None if stream is None else Stream.of(stream, pool.device)
        sid = 0 if s is None else s.ptr
        block = pool.malloc(nbytes, stream=sid)
        mem = _Memory(pool, block.ptr, nbytes, sid)
        return cls._make(block.ptr, shape, _contiguous(shape), dtype, pool.device, mem, s)

    @classmethod
    def from_ptr(cls, ptr: int, shape, dtype, *, device=0, strides=None, owner=None, stream=None) -> "Tensor":
        """Wrap memory cgraw does not own; ``owner`` is kept alive as long as the tensor."""
        shape = _shape(shape)
        dev = device if isinstance(device, Device) else Device(int(device))
        mem = _Memory(None, ptr, 0, 0, owner)
        st = _contiguous(shape) if strides is None else tuple(int(x) for x in strides)
        return cls._make(int(ptr), shape, st, _dtype(dtype), dev, mem,
                         None if stream is None else Stream.of(stream, dev))

    # ------------------------------------------------------------------ properties

    @property
    def ndim(self) -> int:
        """The number of dimensions."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """The number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """The bytes its elements take (``size * itemsize``)."""
        return self.size * self.itemsize

    @property
    def is_contiguous(self) -> bool:
        """True when its strides are C-contiguous (any strides for at most one element)."""
        return self.strides == _contiguous(self.shape) or self.size <= 1

    def __repr__(self) -> str:
        return (f"<cgraw.Tensor shape={self.shape} dtype={self.dtype} device={self.device.ordinal} "
                f"ptr=0x{self.ptr:x}>")

    # ------------------------------------------------------------------ host copies (tests, debugging)

    def to_numpy(self) -> np.ndarray:
        """Copy a contiguous tensor to a new host array (synchronises)."""
        if not self.is_contiguous:
            raise CgrawError("to_numpy() needs a contiguous tensor")
        if self.dtype == "bfloat16":
            raise CgrawError("numpy has no bfloat16; consume the tensor with torch instead")
        out = np.empty(self.shape, dtype=self.dtype)
        if out.nbytes:
            self.device.set_current()
            if self.stream is not None:
                self.stream.synchronize()
            _cuda.ctx_synchronize()
            _cuda.memcpy_dtoh(out.ctypes.data, self.ptr, out.nbytes)
        return out

    def copy_from_numpy(self, arr: np.ndarray) -> "Tensor":
        """Copy host data of the same shape and dtype into a contiguous tensor (synchronous)."""
        arr = np.ascontiguousarray(arr)
        if tuple(arr.shape) != self.shape or arr.dtype != self.dtype:
            raise ValueError(f"host array {arr.shape} {arr.dtype} does not match tensor {self.shape} {self.dtype}")
        if not self.is_contiguous:
            raise CgrawError("copy_from_numpy() needs a contiguous tensor")
        if arr.nbytes:
            self.device.set_current()
            _cuda.ctx_synchronize()
            _cuda.memcpy_htod(self.ptr, arr.ctypes.data, arr.nbytes)
        return self

    # ------------------------------------------------------------------ interchange

    def __dlpack_device__(self) -> tuple[int, int]:
        return (dlpack.kDLCUDA, self.device.ordinal)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """Export a DLPack capsule; the consumer's ``stream`` waits for this tensor's writer."""
        if copy:
            raise BufferError("cgraw.Tensor exports zero-copy only (copy=True is not supported)")
        if dl_device is not None and tuple(dl_device) != (dlpack.kDLCUDA, self.device.ordinal):
            raise BufferError(f"cgraw.Tensor lives on CUDA device {self.device.ordinal}, not {dl_device}")
        versioned = dlpack.wants_versioned(max_version)
        if self.readonly and not versioned:
            raise BufferError("a read-only cgraw.Tensor needs a DLPack 1.x consumer (max_version=(1, 0)); "
                              "legacy capsules cannot carry the read-only flag")
        consumer = dlpack.normalize_consumer_stream(stream)
        if consumer is not None:
            self._order_before(consumer)
        mem = self._mem
        mem.add_export()
        return capsules.make_capsule(
            self.ptr, self.shape, self.strides, self.dtype, (dlpack.kDLCUDA, self.device.ordinal),
            owner=mem, versioned=versioned, readonly=self.readonly,
            on_release=mem.release_export,
        )

    def _order_before(self, consumer: int) -> None:
        """Make the consumer stream (a handle; 1 = legacy, 2 = per-thread) wait for the producer."""
        producer = 0 if self.stream is None else self.stream.ptr
        if producer in (0, 1) and consumer in (0, 1):
            return  # both are the legacy stream
        if producer == consumer:
            return
        ev = _sync_event(self.device)
        _cuda.event_record(ev.handle, _cuda.stream_handle(producer))
        _cuda.stream_wait_event(_cuda.stream_handle(consumer), ev.handle)

    @property
    def __cuda_array_interface__(self) -> dict:
        """CUDA Array Interface v3; ``stream`` names the stream consumers must wait on."""
        if self.dtype == "bfloat16":
            raise TypeError("the CUDA Array Interface has no bfloat16; use DLPack (torch.from_dlpack)")
        dt = np.dtype(self.dtype)
        contiguous = self.is_contiguous
        producer = None if self.stream is None else self.stream.ptr
        return {
            "shape": self.shape,
            "typestr": dt.str,
            "data": (self.ptr if self.size else 0, self.readonly),
            "strides": None if contiguous else tuple(s * dt.itemsize for s in self.strides),
            "version": 3,
            "stream": 1 if producer in (None, 0) else producer,
        }


def from_dlpack(obj, *, stream=None) -> Tensor:
    """Import any DLPack producer (torch, CuPy, cgraw) as a ``cgraw.Tensor``, zero-copy.

    The producer is asked to order its work before ``stream`` (default: the legacy stream); the
    producer's memory stays alive until the returned tensor, and every view of it, is gone.
    """
    if isinstance(obj, Tensor):
        return obj
    dev_type, dev_id = obj.__dlpack_device__()
    if int(dev_type) != dlpack.kDLCUDA:
        raise BufferError(
            f"cgraw.from_dlpack needs CUDA memory; the producer is on DLPack device type {int(dev_type)}"
        )
    s = 1 if stream is None else Stream.of(stream, int(dev_id)).ptr
    try:
        cap = obj.__dlpack__(stream=s, max_version=(1, 0))
    except TypeError:
        cap = obj.__dlpack__(stream=s)
    view = capsules.parse_capsule(cap)
    device = Device(int(view.device[1]))
    mem = _Memory(None, view.ptr, 0, 0, base=view)
    return Tensor._make(view.ptr, tuple(view.shape), tuple(view.strides), view.dtype, device, mem,
                        None if stream is None else Stream.of(stream, device), bool(view.readonly))


def _shape(shape) -> tuple[int, ...]:
    if isinstance(shape, int):
        shape = (shape,)
    out = tuple(int(x) for x in shape)
    if any(x < 0 for x in out):
        raise ValueError(f"{shape=} has a negative dimension")
    return out


def _dtype(dtype):
    if isinstance(dtype, str) and dtype == "bfloat16":
        return "bfloat16"
    return np.dtype(dtype)


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


__all__ = ["Tensor", "from_dlpack"]

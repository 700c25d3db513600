"""DLPack capsules: export (``make_capsule``) and import (``parse_capsule``).

Layer L1, on ``dlpack``'s structs, dtypes, capsule names and C-API prototypes; stdlib and ctypes
otherwise: no CUDA calls, no cuda.bindings, torch or cupy. Each exported struct, its shape and
strides and the caller's ``owner`` live in ``_live`` (keyed by struct address) until the deleter
runs, either from the consumer or from the destructor of a capsule nobody consumed. The consumer
(``parse_capsule``) calls a producer's deleter through ``_call_deleter``, which runs ``_release``
directly when the capsule is one of ours.
"""

from __future__ import annotations

import ctypes
import struct
import sys
import warnings
import weakref
from ctypes import CFUNCTYPE, c_int64, c_void_p
from typing import Callable

from cgraw.dlpack.structs import (
    CAPSULE_NAME,
    CAPSULE_NAME_VERSIONED,
    DLPACK_VERSION,
    NP_TO_DL,
    READ_ONLY,
    USED_NAME,
    USED_NAME_VERSIONED,
    CapsuleType,
    DLDeleter,
    DLManagedTensor,
    DLManagedTensorVersioned,
    capsule_get_name,
    capsule_get_pointer,
    capsule_get_pointer_obj,
    capsule_is_valid,
    capsule_new,
    capsule_set_name,
    from_dl_dtype,
    immortal,
    to_dl_dtype_slow,
)

# Struct address -> (struct buffer, owner, on_release). The buffer holds the managed tensor
# followed by shape[ndim] and strides[ndim]; popping the entry frees it and drops the owner.
_live: dict[int, tuple] = {}


def live_exports() -> int:
    """Number of exported capsules whose deleter has not run yet (leak checks in tests)."""
    return len(_live)


def _report(what: str, exc: BaseException) -> None:
    try:
        if not sys.is_finalizing():
            warnings.warn(f"cgraw.dlpack.structs: {what} raised {exc!r}; ignored", RuntimeWarning, stacklevel=2)
    except BaseException:  # warnings escalated to errors must not escape a C callback
        pass


def _release(addr: int) -> None:
    """Run the producer side of the deleter for the struct at ``addr``; never raises."""
    try:
        if sys.is_finalizing():
            return
        entry = _live.pop(addr, None)
        if entry is None or entry[2] is None:
            return
        try:
            entry[2]()
        except BaseException as e:
            _report("DLPack on_release callback", e)
    except BaseException:
        pass


def _destroy_versioned(cap) -> None:
    # Only an unconsumed capsule still carries the unused name; a consumer renamed it otherwise.
    try:
        if cap and capsule_is_valid(cap, CAPSULE_NAME_VERSIONED):
            _release(capsule_get_pointer(cap, CAPSULE_NAME_VERSIONED))
    except BaseException:
        pass


def _destroy_legacy(cap) -> None:
    try:
        if cap and capsule_is_valid(cap, CAPSULE_NAME):
            _release(capsule_get_pointer(cap, CAPSULE_NAME))
    except BaseException:
        pass


_CapsuleDestructor = CFUNCTYPE(None, c_void_p)
_DELETER = immortal(DLDeleter(_release))
_DESTRUCTOR_V = immortal(_CapsuleDestructor(_destroy_versioned))
_DESTRUCTOR = immortal(_CapsuleDestructor(_destroy_legacy))
_DELETER_ADDR = ctypes.cast(_DELETER, c_void_p).value
_DESTRUCTOR_V_ADDR = ctypes.cast(_DESTRUCTOR_V, c_void_p).value
_DESTRUCTOR_ADDR = ctypes.cast(_DESTRUCTOR, c_void_p).value

# struct.Struct layouts mirroring the ctypes structs ('@' = native sizes and alignment):
# versioned: version(II) manager_ctx deleter flags | data device(ii) ndim dtype(BBH) shape strides byte_offset
# legacy:    data device(ii) ndim dtype(BBH) shape strides byte_offset | manager_ctx deleter
_HEAD_V = "@IIPPQPiiiBBHPPQ"
_HEAD = "@PiiiBBHPPQPP"
if struct.calcsize(_HEAD_V) != ctypes.sizeof(DLManagedTensorVersioned) or struct.calcsize(
    _HEAD
) != ctypes.sizeof(DLManagedTensor):  # pragma: no cover - exotic ABI
    raise ImportError("cgraw.dlpack.structs: struct layout does not match the ctypes DLPack mirrors")

_layouts_v: dict[int, tuple] = {}
_layouts: dict[int, tuple] = {}


def _layout(ndim: int, versioned: bool) -> tuple:
    """(buffer type, packer, offset of shape) for one (ndim, kind); cached."""
    head = _HEAD_V if versioned else _HEAD
    base = struct.calcsize(head)  # already 8-aligned, so shape follows directly
    packer = struct.Struct(f"{head}{ndim}q{ndim}q")
    buf_type = c_int64 * (packer.size // 8)
    entry = (buf_type, packer, base)
    (_layouts_v if versioned else _layouts)[ndim] = entry
    return entry


def make_capsule(
    ptr: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype,
    device: tuple[int, int],
    *,
    owner: object,
    versioned: bool,
    readonly: bool = False,
    on_release: Callable[[], None] | None = None,
    byte_offset: int = 0,
):
    """Export memory as a DLPack PyCapsule without copying.

    Args:
        ptr: data pointer (ignored for size-0 tensors, which get data=NULL per the spec).
        shape, strides: per-dimension extents and strides, strides in ELEMENTS (never NULL).
        dtype: anything ``to_dl_dtype`` accepts.
        device: ``(device_type, device_id)``, e.g. ``(kDLCUDA, 0)``.
        owner: kept alive until the deleter runs.
        versioned: "dltensor_versioned" (DLPack 1.x struct) if true, else legacy "dltensor".
        readonly: sets the READ_ONLY flag. Legacy capsules cannot express it and ignore it.
        on_release: called exactly once when the consumer (or the unconsumed capsule's
            destructor) releases the tensor; exceptions become a RuntimeWarning.
        byte_offset: added to ``ptr`` by the consumer.

    Raises:
        ValueError: ``len(shape) != len(strides)`` or a field does not fit its C type.
        TypeError: unsupported dtype.
    """
    ndim = len(shape)
    if len(strides) != ndim:
        raise ValueError(f"len(shape)={ndim} != len(strides)={len(strides)}")
    try:
        code, bits, lanes = NP_TO_DL[dtype]
    except (KeyError, TypeError):
        code, bits, lanes = to_dl_dtype_slow(dtype)
    try:
        buf_type, packer, shape_off = (_layouts_v if versioned else _layouts)[ndim]
    except KeyError:
        buf_type, packer, shape_off = _layout(ndim, versioned)
    buf = buf_type()
    addr = ctypes.addressof(buf)
    if ndim:
        shape_ptr = addr + shape_off
        strides_ptr = shape_ptr + 8 * ndim
        if 0 in shape:
            ptr = 0
    else:
        shape_ptr = strides_ptr = 0
    dev_type, dev_id = device
    try:
        if versioned:
            packer.pack_into(
                buf, 0, 1, DLPACK_VERSION[1], 0, _DELETER_ADDR, READ_ONLY if readonly else 0,
                ptr, dev_type, dev_id, ndim, code, bits, lanes, shape_ptr, strides_ptr,
                byte_offset, *shape, *strides,
            )
        else:
            packer.pack_into(
                buf, 0, ptr, dev_type, dev_id, ndim, code, bits, lanes, shape_ptr, strides_ptr,
                byte_offset, 0, _DELETER_ADDR, *shape, *strides,
            )
    except struct.error as e:
        raise ValueError(
            f"cannot export DLPack tensor ({e}): {ptr=} {shape=} {strides=} {device=} {byte_offset=}"
        ) from None
    _live[addr] = (buf, owner, on_release)
    try:
        if versioned:
            return capsule_new(addr, CAPSULE_NAME_VERSIONED, _DESTRUCTOR_V_ADDR)
        return capsule_new(addr, CAPSULE_NAME, _DESTRUCTOR_ADDR)
    except BaseException:
        del _live[addr]
        raise


def _call_deleter(deleter_addr: int | None, addr: int) -> None:
    if not deleter_addr:
        return
    try:
        if deleter_addr == _DELETER_ADDR:  # our own export: skip the C round trip
            _release(addr)
        else:
            DLDeleter(deleter_addr)(addr)
    except BaseException as e:
        _report("DLPack deleter", e)


# ---------------------------------------------------------------------------------------------
# Consumer

_OFF_DELETER_V = DLManagedTensorVersioned.deleter.offset
_OFF_DELETER = DLManagedTensor.deleter.offset


class DLPackView:
    """An imported DLPack tensor: a borrowed pointer plus metadata, owning the producer's deleter.

    ``release()`` calls the producer's deleter exactly once; garbage collection does the same.
    ``ptr`` already includes ``byte_offset``; ``strides`` are in elements.
    """

    __slots__ = ("ptr", "shape", "strides", "dtype", "device", "readonly", "versioned",
                 "_finalizer", "__weakref__")

    def release(self) -> None:
        """Call the producer's deleter (idempotent). ``ptr`` must not be used afterwards."""
        self._finalizer()

    @property
    def is_released(self) -> bool:
        return not self._finalizer.alive

    def __repr__(self) -> str:
        return (f"DLPackView(ptr={self.ptr:#x}, shape={self.shape}, strides={self.strides}, "
                f"dtype={self.dtype}, device={self.device}, readonly={self.readonly}, "
                f"versioned={self.versioned}, released={self.is_released})")


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def parse_capsule(capsule) -> DLPackView:
    """Take ownership of a "dltensor_versioned" or "dltensor" capsule and describe its tensor.

    The capsule is renamed to its "used_" name, so its producer's destructor no longer frees it.

    Raises:
        TypeError: not a PyCapsule, or not a DLPack one; unsupported dtype (tensor released).
        ValueError: the capsule was already consumed.
        BufferError: unsupported major version (the deleter has been called).
    """
    if type(capsule) is not CapsuleType:
        raise TypeError(f"expected a DLPack PyCapsule, got {type(capsule).__name__}")
    name = capsule_get_name(capsule)
    if name == CAPSULE_NAME_VERSIONED:
        versioned = True
    elif name == CAPSULE_NAME:
        versioned = False
    elif name in (USED_NAME_VERSIONED, USED_NAME):
        raise ValueError(f"DLPack capsule {name.decode()!r} was already consumed; "
                         "call __dlpack__() again for a fresh one")
    else:
        raise TypeError(f"not a DLPack capsule: name {name!r}")
    addr = capsule_get_pointer_obj(capsule, name)
    capsule_set_name(capsule, USED_NAME_VERSIONED if versioned else USED_NAME)  # ownership is ours from here
    if versioned:
        deleter_addr = c_void_p.from_address(addr + _OFF_DELETER_V).value
        managed = DLManagedTensorVersioned.from_address(addr)
        major = managed.version.major
        if major != 1:
            _call_deleter(deleter_addr, addr)
            raise BufferError(f"unsupported DLPack major version {major}.{managed.version.minor} "
                              f"(this consumer supports {DLPACK_VERSION[0]}.x)")
        flags, t = managed.flags, managed.dl_tensor
    else:
        deleter_addr = c_void_p.from_address(addr + _OFF_DELETER).value
        flags, t = 0, DLManagedTensor.from_address(addr).dl_tensor

    view = DLPackView()
    view._finalizer = weakref.finalize(view, _call_deleter, deleter_addr, addr)
    try:
        ndim = t.ndim
        shape = tuple(t.shape[:ndim]) if ndim else ()
        view.shape = shape
        view.strides = tuple(t.strides[:ndim]) if ndim and t.strides else _contiguous_strides(shape)
        view.dtype = from_dl_dtype(t.dtype.code, t.dtype.bits, t.dtype.lanes)
        view.ptr = (t.data or 0) + t.byte_offset
        view.device = (t.device.device_type, t.device.device_id)
        view.readonly = bool(flags & READ_ONLY)
        view.versioned = versioned
    except BaseException:
        view.release()
        raise
    return view

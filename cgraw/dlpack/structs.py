"""DLPack 1.x definitions: structs, flags, dtype mapping, capsule names, the Python C-API
prototypes for capsules, and the array-API protocol helpers.

Layer L1. Imports only the stdlib, ctypes and numpy: it makes NO CUDA calls and must not import
cuda.bindings, torch or cupy. Building and parsing capsules (and the lifetime of what they
export) is ``dlpack.capsules``, which builds on this module; stream synchronisation is the
exporter's job (``tensor.py``).
"""

from __future__ import annotations

import ctypes
from ctypes import (
    CFUNCTYPE,
    POINTER,
    PYFUNCTYPE,
    c_char_p,
    c_int32,
    c_int64,
    c_uint8,
    c_uint16,
    c_uint32,
    c_uint64,
    c_void_p,
    py_object,
)

import numpy as np

# Version written into versioned capsules. We follow the 1.2 rule (strides never NULL when
# ndim != 0) and use no 1.3-only feature; consumers check only the major version.
DLPACK_VERSION = (1, 2)

kDLCPU = 1
kDLCUDA = 2
kDLCUDAHost = 3
kDLCUDAManaged = 13

kDLInt = 0
kDLUInt = 1
kDLFloat = 2
kDLBfloat = 4
kDLComplex = 5
kDLBool = 6

READ_ONLY = 1
IS_COPIED = 2
IS_SUBBYTE_TYPE_PADDED = 4


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", c_void_p),
        ("device", DLDevice),
        ("ndim", c_int32),
        ("dtype", DLDataType),
        ("shape", POINTER(c_int64)),
        ("strides", POINTER(c_int64)),
        ("byte_offset", c_uint64),
    ]


# Both deleters take the struct pointer; declaring it void* lets one callback serve both kinds.
DLDeleter = CFUNCTYPE(None, c_void_p)


class DLManagedTensor(ctypes.Structure):
    """Legacy (pre-1.0, capsule name "dltensor") managed tensor."""

    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p), ("deleter", DLDeleter)]


class DLManagedTensorVersioned(ctypes.Structure):
    """DLPack >= 1.0 managed tensor (capsule name "dltensor_versioned")."""

    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", c_void_p),
        ("deleter", DLDeleter),
        ("flags", c_uint64),
        ("dl_tensor", DLTensor),
    ]


# ---------------------------------------------------------------------------------------------
# dtypes

_DL_TO_NP: dict[tuple[int, int, int], object] = {(kDLBool, 8, 1): np.dtype(np.bool_)}
for _t in (np.int8, np.int16, np.int32, np.int64):
    _DL_TO_NP[(kDLInt, np.dtype(_t).itemsize * 8, 1)] = np.dtype(_t)
for _t in (np.uint8, np.uint16, np.uint32, np.uint64):
    _DL_TO_NP[(kDLUInt, np.dtype(_t).itemsize * 8, 1)] = np.dtype(_t)
for _t in (np.float16, np.float32, np.float64):
    _DL_TO_NP[(kDLFloat, np.dtype(_t).itemsize * 8, 1)] = np.dtype(_t)
for _t in (np.complex64, np.complex128):
    _DL_TO_NP[(kDLComplex, np.dtype(_t).itemsize * 8, 1)] = np.dtype(_t)
_DL_TO_NP[(kDLBfloat, 16, 1)] = "bfloat16"

# Fast-path lookup (numpy dtype -> DLPack key): canonical dtypes, scalar types and names all hit one dict.
NP_TO_DL: dict[object, tuple[int, int, int]] = {}
for _key, _dt in _DL_TO_NP.items():
    NP_TO_DL[_dt] = _key
    if _dt != "bfloat16":
        NP_TO_DL[_dt.type] = _key
        NP_TO_DL[_dt.name] = _key
del _t, _key, _dt

_SUPPORTED = "bool, int8-64, uint8-64, float16/32/64, complex64/128, bfloat16"
_CODE_NAMES = {kDLInt: "int", kDLUInt: "uint", kDLFloat: "float", 3: "opaque handle",
               kDLBfloat: "bfloat", kDLComplex: "complex", kDLBool: "bool"}


def to_dl_dtype(dtype) -> tuple[int, int, int]:
    """Map a numpy dtype (or scalar type, or name, or "bfloat16") to DLPack ``(code, bits, lanes)``.

    Raises:
        TypeError: the dtype has no DLPack equivalent here (structured, object, non-native byte
            order, longdouble, datetime, ...).
    """
    try:
        return NP_TO_DL[dtype]
    except (KeyError, TypeError):
        return to_dl_dtype_slow(dtype)


def to_dl_dtype_slow(dtype) -> tuple[int, int, int]:
    """``to_dl_dtype`` for what ``NP_TO_DL`` does not hold as it is (raises ``TypeError``)."""
    if dtype is None:  # np.dtype(None) would silently mean float64
        raise TypeError(f"unsupported dtype for DLPack: None (supported: {_SUPPORTED})")
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError) as e:
        raise TypeError(f"unsupported dtype for DLPack: {dtype!r} (supported: {_SUPPORTED})") from e
    if dt.name == "bfloat16" and dt.itemsize == 2:  # e.g. ml_dtypes.bfloat16
        return (kDLBfloat, 16, 1)
    key = NP_TO_DL.get(dt) if dt.isnative else None
    if key is None:
        why = " (non-native byte order)" if not dt.isnative else ""
        raise TypeError(f"unsupported dtype for DLPack: {dt!r}{why} (supported: {_SUPPORTED})")
    return key


def from_dl_dtype(code: int, bits: int, lanes: int = 1):
    """Map DLPack ``(code, bits, lanes)`` to a numpy dtype, or the string "bfloat16".

    Raises:
        TypeError: vector lanes, sub-byte, fp8/fp6/fp4 or other types numpy cannot represent.
    """
    try:
        return _DL_TO_NP[(code, bits, lanes)]
    except KeyError:
        kind = _CODE_NAMES.get(code, "fp8/fp6/fp4 or unknown")
        raise TypeError(
            f"unsupported DLPack dtype code={code} ({kind}), bits={bits}, lanes={lanes} "
            f"(supported: {_SUPPORTED}, lanes=1)"
        ) from None


# ---------------------------------------------------------------------------------------------
# Python C-API through cgraw's own prototypes (never mutate the shared ctypes.pythonapi attributes):
# ``capsule_*`` are PyCapsule_New, _IsValid, _GetPointer (by address, or ``_obj`` by object), _GetName, _SetName.

capsule_new = PYFUNCTYPE(py_object, c_void_p, c_char_p, c_void_p)(("PyCapsule_New", ctypes.pythonapi))
capsule_is_valid = PYFUNCTYPE(ctypes.c_int, c_void_p, c_char_p)(("PyCapsule_IsValid", ctypes.pythonapi))
capsule_get_pointer = PYFUNCTYPE(c_void_p, c_void_p, c_char_p)(("PyCapsule_GetPointer", ctypes.pythonapi))
capsule_get_pointer_obj = PYFUNCTYPE(c_void_p, py_object, c_char_p)(("PyCapsule_GetPointer", ctypes.pythonapi))
capsule_get_name = PYFUNCTYPE(c_char_p, py_object)(("PyCapsule_GetName", ctypes.pythonapi))
capsule_set_name = PYFUNCTYPE(ctypes.c_int, py_object, c_char_p)(("PyCapsule_SetName", ctypes.pythonapi))


def immortal(obj):
    """Leak one reference so ``obj`` outlives module teardown (capsules may die after it)."""
    ctypes.pythonapi.Py_IncRef(py_object(obj))
    return obj


# Capsule names must stay allocated for the life of the process (C keeps the char*).
CAPSULE_NAME_VERSIONED = immortal(b"dltensor_versioned")
CAPSULE_NAME = immortal(b"dltensor")
USED_NAME_VERSIONED = immortal(b"used_dltensor_versioned")
USED_NAME = immortal(b"used_dltensor")

# The type of a PyCapsule (``parse_capsule`` checks it exactly).
CapsuleType = type(capsule_new(id(CAPSULE_NAME), b"cgraw.dlpack.structs.probe", None))


# ---------------------------------------------------------------------------------------------
# Array-API protocol helpers


def normalize_consumer_stream(stream) -> int | None:
    """Normalise the ``stream=`` a consumer passed to ``__dlpack__`` for a CUDA producer.

    Returns 1 for the legacy default stream (``None`` or 1), 2 for the per-thread default stream,
    the stream pointer for values > 2, and ``None`` for -1 ("do not synchronize").

    Raises:
        ValueError: 0 (ambiguous, disallowed for CUDA) or another negative value.
        TypeError: not an int or None.
    """
    if stream is None:
        return 1
    if isinstance(stream, bool) or not hasattr(type(stream), "__index__"):
        raise TypeError(f"stream must be an int or None, got {type(stream).__name__}")
    s = stream.__index__()
    if s > 0:
        return s
    if s == -1:
        return None
    if s == 0:
        raise ValueError("stream=0 is disallowed for CUDA by the DLPack/array-API spec; "
                         "pass 1 (legacy default), 2 (per-thread default) or a stream pointer")
    raise ValueError(f"invalid stream={s}; expected None, -1, 1, 2 or a stream pointer")


def wants_versioned(max_version) -> bool:
    """True iff the consumer's ``max_version`` asks for a DLPack >= 1.0 versioned capsule."""
    return max_version is not None and max_version[0] >= 1

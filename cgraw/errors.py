"""cgraw's exception types.

Layer L1: imports only ``allocator.errors``. ``CudaError`` carries the driver call, the error
name and code, the driver's explanation and, where the cause is usually the same, a hint.
"""

from __future__ import annotations

from allocator.errors import (
    AllocatorError,
    InvalidFree,
    PoolClosed,
    PoolExhausted,
    SnapshotMismatch,
)

__all__ = [
    "AllocatorError",
    "CaptureError",
    "CgrawError",
    "ControlFlowError",
    "CudaError",
    "CudaUnavailableError",
    "InvalidFree",
    "OutOfMemoryError",
    "PoolClosed",
    "PoolExhausted",
    "ResourceLeakWarning",
    "SkipCall",
    "SnapshotMismatch",
    "TreeError",
    "UnsafeCallError",
]


class CgrawError(Exception):
    """Base class of cgraw's own errors."""


class CudaUnavailableError(CgrawError, RuntimeError):
    """No CUDA driver or no CUDA device was found on this machine."""


class CudaError(CgrawError, RuntimeError):
    """A CUDA driver call failed.

    Attributes:
        call: the driver function, for example ``"cuStreamEndCapture"``.
        code: the integer ``CUresult``.
        name: the error's name, for example ``"CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"``.
        hint: the usual cause and fix, or ``""``.
    """

    def __init__(self, call: str, code: int, name: str, description: str = "", hint: str = ""):
        self.call = call
        self.code = int(code)
        self.name = name
        self.description = description
        self.hint = hint
        msg = f"{call}: {name}"
        if description:
            msg += f": {description}"
        if hint:
            msg += f" (hint: {hint})"
        super().__init__(msg)

    def __reduce__(self):
        return (type(self), (self.call, self.code, self.name, self.description, self.hint))


class CaptureError(CudaError):
    """A stream capture was invalidated, or the captured work cannot be made into a graph."""


class OutOfMemoryError(CudaError, MemoryError):
    """The driver could not allocate device memory (``CUDA_ERROR_OUT_OF_MEMORY``).

    It is a ``MemoryError``, so ``except MemoryError`` catches it; a pool turns it into
    ``PoolExhausted`` with the pool's figures, chained to this error.
    """


class ControlFlowError(CgrawError, ValueError):
    """``cgraw.while_loop`` or ``cgraw.cond`` was given functions or values that break its rules:
    a body whose result differs from the carried values (structure, shape or dtype), branches
    whose results differ, or a predicate that is not a boolean scalar. The message names the
    value and the difference."""


class TreeError(CgrawError, RuntimeError):
    """A graph-tree invariant was violated."""


class UnsafeCallError(CgrawError, RuntimeError):
    """A function marked ``@cgraw.unsafe`` was called inside a capture. Not a driver error: the
    capture is invalidated by cgraw, and a graphed function runs eagerly with this reason."""


class SkipCall(Exception):
    """Internal to graph trees: this call cannot be graphed; run it eagerly. ``str(exc)`` is the
    reason. ``dirty``: the failure came after a capture, whose blocks are still in the tree's pool
    (the next recording must restore the pool's checkpoint first). ``rewarm``: only this call runs
    eagerly and the next one warms up again (what broke the capture happens once: torch.compile
    compiling code)."""

    def __init__(self, reason: str, *, dirty: bool = False, rewarm: bool = False):
        super().__init__(reason)
        self.dirty = dirty
        self.rewarm = rewarm


class ResourceLeakWarning(ResourceWarning):
    """A CUDA handle could not be released cleanly; the test suite turns this into an error."""

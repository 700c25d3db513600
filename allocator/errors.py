"""Exceptions raised by the allocator package, and the argument checks that raise them.

Layer A: pure Python, stdlib only; imports nothing from cgraw and nothing from CUDA.
"""

from __future__ import annotations

import operator


class AllocatorError(Exception):
    """Base class of every error the pool raises."""


class PoolExhausted(AllocatorError, MemoryError):
    """The pool's limit, or its segment source, cannot satisfy a request.

    Carries the figures a user needs to act: ``requested`` bytes, bytes ``in_use``
    (reserved by the pool) and the ``limit`` (None when unlimited).
    """

    def __init__(self, message: str, *, requested: int, in_use: int, limit: int | None):
        super().__init__(message)
        self.requested = requested
        self.in_use = in_use
        self.limit = limit


class InvalidFree(AllocatorError, ValueError):
    """A free of a block that is not live in this pool (double free, foreign pointer)."""


class SnapshotMismatch(AllocatorError, ValueError):
    """A snapshot was restored into a pool other than the one that took it."""


class PoolClosed(AllocatorError, RuntimeError):
    """The pool was used after ``close()``."""


class SnapshotStale(AllocatorError):
    """A snapshot needs a segment that has been released to the source since it was taken.

    Raised by ``Pool.restore``; the pool is left unchanged. Spare segments still count as
    present, so only ``trim()``, ``close()`` or a limit-driven release causes it.
    """


class InvariantError(AllocatorError, AssertionError):
    """``check_invariants`` found the pool's bookkeeping inconsistent (a bug in the pool)."""


def fmt_bytes(n: int) -> str:
    """``n`` bytes for a message: ``"3.0 MiB"``, ``"512 B"``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def check_nbytes(nbytes: object) -> int:
    """``nbytes`` as an int > 0, else TypeError/ValueError naming the value."""
    if isinstance(nbytes, bool):
        raise TypeError(f"{nbytes=} must be an int, not bool")
    try:
        value = operator.index(nbytes)
    except TypeError:
        raise TypeError(f"{nbytes=} must be an int, not {type(nbytes).__name__}") from None
    if value <= 0:
        raise ValueError(f"{nbytes=} must be > 0")
    return value


def check_stream(stream: object) -> int:
    """``stream`` as an int stream id, else TypeError naming the value."""
    if isinstance(stream, bool):
        raise TypeError(f"{stream=} must be an int stream id, not bool")
    try:
        return operator.index(stream)
    except TypeError:
        raise TypeError(f"{stream=} must be an int stream id, not {type(stream).__name__}") from None


def check_positive(name: str, value: object) -> int:
    """``value`` if it is an int > 0, else ValueError naming ``name``."""
    if type(value) is not int or value <= 0:
        raise ValueError(f"{name}={value!r} must be an int > 0")
    return value

"""Where segments come from: the ``SegmentSource`` and ``StreamEvents`` protocols, and
``IntRangeSource``, a deterministic fake address space for tests and CPU benchmarks.

Layer A: pure Python, stdlib plus ``allocator.errors``; must not import cgraw or anything
CUDA. cgraw implements both protocols over the driver (``cuMemAlloc``, CUDA events); the pool
itself only ever sees integers.
"""

from __future__ import annotations

import operator
from typing import Protocol, runtime_checkable

from allocator.errors import InvalidFree


@runtime_checkable
class SegmentSource(Protocol):
    """The memory behind a pool: whole segments, reserved and released as a unit."""

    def reserve(self, nbytes: int) -> int:
        """Reserve ``nbytes`` and return the base address.

        Raises:
            MemoryError: when the memory is not available (``PoolExhausted`` is fine too).
        """
        ...

    def release(self, addr: int, nbytes: int) -> None:
        """Give back a segment that ``reserve`` returned, with the same ``nbytes``."""
        ...


@runtime_checkable
class StreamEvents(Protocol):
    """How the pool learns that frees on one stream have completed, before reuse on another."""

    def record(self, stream_id: int) -> object:
        """Mark the current end of ``stream_id``'s work; return an opaque immutable token.

        May return None when no event can be recorded now (the pool then skips that stream).
        """
        ...

    def query(self, token: object) -> bool:
        """True once all work on the token's stream up to ``record`` has completed."""
        ...


class IntRangeSource:
    """A fake ``SegmentSource`` over plain integers.

    Addresses increase monotonically and are never reused, so a stale pointer can never alias
    new memory. Every release is checked against the live segments.

    Args:
        capacity: the most bytes that may be reserved at once, or None for no cap; a reserve
            past it raises ``MemoryError``.
        base: the first address handed out.
        alignment: every base address is a multiple of this.
    """

    def __init__(self, capacity: int | None = None, *, base: int = 1 << 32, alignment: int = 512):
        if capacity is not None and (type(capacity) is not int or capacity < 0):
            raise ValueError(f"{capacity=} must be None or an int >= 0")
        if type(base) is not int or base < 0:
            raise ValueError(f"{base=} must be an int >= 0")
        if type(alignment) is not int or alignment <= 0:
            raise ValueError(f"{alignment=} must be an int > 0")
        self.capacity = capacity
        self.alignment = alignment
        self.reserved_bytes = 0
        self.num_reserves = 0
        self.num_releases = 0
        self._next = base
        self._live: dict[int, int] = {}  # base address -> nbytes of every unreleased segment

    def reserve(self, nbytes: int) -> int:
        """Return the base of a fresh ``nbytes`` range, above every earlier one.

        Raises:
            MemoryError: when ``capacity`` would be exceeded.
        """
        nbytes = operator.index(nbytes)
        if nbytes <= 0:
            raise ValueError(f"{nbytes=} must be > 0")
        if self.capacity is not None and self.reserved_bytes + nbytes > self.capacity:
            raise MemoryError(
                f"IntRangeSource: cannot reserve {nbytes} bytes: {self.reserved_bytes} reserved, "
                f"capacity {self.capacity}"
            )
        align = self.alignment
        addr = -(-self._next // align) * align
        self._next = addr + nbytes
        self._live[addr] = nbytes
        self.reserved_bytes += nbytes
        self.num_reserves += 1
        return addr

    def release(self, addr: int, nbytes: int) -> None:
        """Release a live segment.

        Raises:
            InvalidFree: ``addr`` is not a live segment, or ``nbytes`` differs from its size.
        """
        size = self._live.get(addr)
        if size is None:
            raise InvalidFree(f"IntRangeSource: release of addr=0x{addr:x}: not a live segment "
                              f"(double release?)")
        if size != nbytes:
            raise InvalidFree(f"IntRangeSource: release of addr=0x{addr:x} with {nbytes=}, "
                              f"segment has {size} bytes")
        del self._live[addr]
        self.reserved_bytes -= size
        self.num_releases += 1

    @property
    def live_segments(self) -> dict[int, int]:
        """A copy of base address -> nbytes for every segment not yet released."""
        return dict(self._live)

    def __repr__(self) -> str:
        return (
            f"IntRangeSource(segments={len(self._live)}, reserved_bytes={self.reserved_bytes}, "
            f"capacity={self.capacity})"
        )

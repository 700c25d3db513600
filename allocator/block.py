"""``Block``: one piece of a segment, free or live, in the pool's per-segment linked list.

Layer A: pure Python, stdlib only; must not import cgraw or anything CUDA. A segment is tiled
exactly by its blocks, linked through ``prev``/``next`` in address order. Blocks are the
pool's own nodes and are handed out by ``Pool.malloc``. A block's ``ptr`` never changes, but
once freed its other fields may, and the object may be handed out again; ``Pool.free`` looks
blocks up by address and never trusts the handle.
"""

from __future__ import annotations


class Block:
    """A contiguous range ``[ptr, ptr + size)`` inside one segment.

    Attributes:
        ptr: start address (int).
        size: bytes, a multiple of the pool's ``round_to``.
        stream: id of the stream the block is live on, or free on.
        requested: bytes asked for by ``malloc`` (0 while free).
        is_free: whether the block is in the pool's free lists.
        prev: the block just below in the same segment, or None at the segment start.
        next: the block just above in the same segment, or None at the segment end.
        seq: the pool's free counter when the block last became free on ``stream``
            (used to decide which frees a recorded stream event covers).
    """

    __slots__ = ("ptr", "size", "stream", "requested", "is_free", "prev", "next", "seq")

    def __init__(
        self,
        ptr: int,
        size: int,
        stream: int,
        requested: int,
        is_free: bool,
        prev: Block | None,
        next: Block | None,  # noqa: A002 - mirrors the attribute
        seq: int,
    ):
        self.ptr = ptr
        self.size = size
        self.stream = stream
        self.requested = requested
        self.is_free = is_free
        self.prev = prev
        self.next = next
        self.seq = seq

    @property
    def end(self) -> int:
        """One past the last byte of the block."""
        return self.ptr + self.size

    def __repr__(self) -> str:
        state = "free" if self.is_free else f"live requested={self.requested}"
        return f"Block(ptr=0x{self.ptr:x}, size={self.size}, stream={self.stream}, {state})"

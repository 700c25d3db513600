"""Pool checkpoints as frozen values: taking, applying, and ``check_invariants`` for tests.

Layer A: pure Python, stdlib plus ``allocator.errors``/``bins``/``block``; must not import
cgraw, anything CUDA, or ``allocator.pool`` (these functions work on a ``Pool``'s fields under
its lock). A ``PoolSnapshot`` holds only tuples of ints and the opaque event tokens, never
memory contents, and compares equal by value. Restoring makes the segments that the snapshot
lacks *spare*: still reserved from the source (a sibling graph may use them) but outside the
bookkeeping. The pool takes the earliest-reserved spare that is big enough before asking the
source, so replaying the same calls after a restore returns the same pointers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from allocator.bins import Arena, round_up
from allocator.block import Block
from allocator.errors import InvariantError


class SegmentRecord(NamedTuple):
    """One segment in the pool's bookkeeping."""

    base: int
    nbytes: int


class BlockRecord(NamedTuple):
    """One block as the snapshot saw it (see ``Block`` for the fields)."""

    ptr: int
    size: int
    stream: int
    is_free: bool
    requested: int
    seq: int


class PendingRecord(NamedTuple):
    """A recorded, not yet harvested event: frees on ``stream`` with seq <= ``seq`` become
    reusable by other streams once ``token`` has completed."""

    stream: int
    token: object
    seq: int


@dataclass(frozen=True)
class PoolSnapshot:
    """Everything that decides a pool's future behaviour, as an immutable value.

    Attributes:
        pool_id: identity of the pool that took it; ``restore`` into another pool is refused.
        segments: bookkept segments, by address (spare segments are not included).
        blocks: every block of every segment, by address.
        pending: outstanding cross-stream events, by stream id.
        peak_allocated_bytes, peak_reserved_bytes, num_mallocs, num_frees: stats counters;
            ``num_frees`` is also the pool's free sequence number (see ``Block.seq``).
    """

    pool_id: int
    segments: tuple[SegmentRecord, ...]
    blocks: tuple[BlockRecord, ...]
    pending: tuple[PendingRecord, ...]
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    num_mallocs: int
    num_frees: int

    @property
    def live(self) -> tuple[tuple[int, int], ...]:
        """``(ptr, size)`` of every live block, by address."""
        return tuple((b.ptr, b.size) for b in self.blocks if not b.is_free)

    @property
    def allocated_bytes(self) -> int:
        return sum(b.size for b in self.blocks if not b.is_free)

    @property
    def reserved_bytes(self) -> int:
        return sum(s.nbytes for s in self.segments)


@dataclass(frozen=True)
class RestoreDelta:
    """What ``Pool.restore`` changed, as ``(ptr, size)`` pairs sorted by address.

    Attributes:
        became_free: live before the restore, not live in the snapshot.
        became_live: live in the snapshot, not live before the restore.
    """

    became_free: tuple[tuple[int, int], ...]
    became_live: tuple[tuple[int, int], ...]


def take_snapshot(pool: Any) -> PoolSnapshot:
    """Build ``pool``'s snapshot; the caller holds its lock. O(blocks)."""
    segments = tuple(SegmentRecord(b, pool._segments[b]) for b in pool._seg_bases)
    records = []
    append = records.append
    for base in pool._seg_bases:
        b = pool._blocks[base]
        while b is not None:
            append(BlockRecord(b.ptr, b.size, b.stream, b.is_free, b.requested, b.seq))
            b = b.next
    pending = tuple(PendingRecord(s, tok, seq) for s, (tok, seq) in sorted(
        pool._pending.items(), key=lambda item: item[0]))
    return PoolSnapshot(
        pool_id=pool._uid, segments=segments, blocks=tuple(records), pending=pending,
        peak_allocated_bytes=pool._peak_allocated, peak_reserved_bytes=pool._peak_reserved,
        num_mallocs=pool._num_mallocs, num_frees=pool._num_frees,
    )


def apply_snapshot(pool: Any, snap: PoolSnapshot) -> RestoreDelta:
    """Rebuild ``pool``'s bookkeeping from ``snap``; the caller holds the lock and has checked
    that every segment of ``snap`` is held (bookkept or spare). O(blocks)."""
    old_blocks = pool._blocks
    old_live = {(b.ptr, b.size) for b in old_blocks.values() if not b.is_free}
    snap_segments = dict(snap.segments)
    spares = pool._spares
    for base, nbytes in pool._segments.items():
        if snap_segments.get(base) != nbytes:
            spares[base] = nbytes
    for base, nbytes in snap_segments.items():
        if spares.get(base) == nbytes:
            del spares[base]
    pool._spare_bytes = sum(spares.values())
    pool._segments = snap_segments
    pool._seg_bases = sorted(snap_segments)
    pool._reserved = sum(snap_segments.values())

    blocks: dict[int, Block] = {}
    bins: dict[int, dict[int, list[int]]] = {}
    new_live = set()
    allocated = 0
    prev = None
    for rec in snap.blocks:  # by address, so every bin list comes out sorted
        if rec.ptr in snap_segments:
            prev = None
        block = old_blocks.get(rec.ptr)
        if block is None or block.is_free or rec.is_free or block.size != rec.size:
            block = Block(rec.ptr, rec.size, rec.stream, rec.requested, rec.is_free, prev, None, rec.seq)
        else:  # the same live range: keep the caller's handle object
            block.stream, block.requested, block.seq, block.prev = rec.stream, rec.requested, rec.seq, prev
        block.next = None
        if prev is not None:
            prev.next = block
        blocks[rec.ptr] = block
        if rec.is_free:
            bins.setdefault(rec.stream, {}).setdefault(rec.size, []).append(rec.ptr)
        else:
            new_live.add((rec.ptr, rec.size))
            allocated += rec.size
        prev = block
    pool._blocks = blocks
    arenas = {}
    for stream, by_size in bins.items():
        arena = arenas[stream] = Arena()
        arena.bins = by_size
        arena.sizes = sorted(by_size)
    pool._arenas = arenas
    pool._pending = {p.stream: (p.token, p.seq) for p in snap.pending}
    pool._allocated = allocated
    pool._peak_allocated = snap.peak_allocated_bytes
    pool._peak_reserved = snap.peak_reserved_bytes
    pool._num_mallocs = snap.num_mallocs
    pool._num_frees = snap.num_frees
    return RestoreDelta(
        became_free=tuple(sorted(old_live - new_live)), became_live=tuple(sorted(new_live - old_live)))


def _fail(pool: Any, message: str) -> None:
    raise InvariantError(f"pool {pool.name!r}: invariant violated: {message}")


def check_invariants(pool: Any) -> None:
    """Check a ``Pool``'s bookkeeping from scratch; for tests and debugging. O(blocks).

    Checks that segments do not overlap, that blocks tile each segment exactly with consistent
    links, that no two adjacent blocks free on the same stream are left unmerged, that the free
    lists hold exactly the free blocks, and that the counters add up.

    Raises:
        InvariantError: (an ``AssertionError``) naming the first violation found.
    """
    with pool._lock:
        _check_locked(pool)


def _check_locked(pool: Any) -> None:
    round_to = pool._round_to
    if pool._closed:
        if pool._segments or pool._spares or pool._blocks or pool._births:
            _fail(pool, "a closed pool still holds segments or blocks")
        return
    ranges = sorted([(b, s, "segment") for b, s in pool._segments.items()]
                    + [(b, s, "spare") for b, s in pool._spares.items()])
    for (b0, s0, k0), (b1, _, k1) in zip(ranges, ranges[1:], strict=False):
        if b0 + s0 > b1:
            _fail(pool, f"{k0} 0x{b0:x}+{s0} overlaps {k1} 0x{b1:x}")
    if sorted(pool._segments) != pool._seg_bases:
        _fail(pool, "sorted segment index out of date")
    if pool._births.keys() != pool._segments.keys() | pool._spares.keys():
        _fail(pool, "reserve-order map does not match the held segments")
    seen: dict[int, object] = {}
    free: set[tuple[int, int, int]] = set()
    allocated = live = 0
    for base, nbytes in pool._segments.items():
        block = pool._blocks.get(base)
        if block is None:
            _fail(pool, f"segment 0x{base:x} has no block at its base")
        if block.prev is not None:
            _fail(pool, f"first block of segment 0x{base:x} has a prev link")
        end = base
        prev = None
        while block is not None:
            if block.ptr != end:
                _fail(pool, f"gap or overlap at 0x{end:x} (next block at 0x{block.ptr:x})")
            if block.size <= 0 or block.size % round_to:
                _fail(pool, f"block 0x{block.ptr:x} has size {block.size}")
            if block.prev is not prev:
                _fail(pool, f"block 0x{block.ptr:x} prev link is wrong")
            if pool._blocks.get(block.ptr) is not block:
                _fail(pool, f"block 0x{block.ptr:x} missing from the address index")
            if block.seq > pool._num_frees:
                _fail(pool, f"block 0x{block.ptr:x} seq {block.seq} > pool num_frees {pool._num_frees}")
            if block.is_free:
                if prev is not None and prev.is_free and prev.stream == block.stream:
                    _fail(pool, f"adjacent free blocks 0x{prev.ptr:x}, 0x{block.ptr:x} on stream "
                                f"{block.stream} not merged")
                if block.requested != 0:
                    _fail(pool, f"free block 0x{block.ptr:x} has requested={block.requested}")
                free.add((block.stream, block.size, block.ptr))
            else:
                if not 0 < block.requested or round_up(block.requested, round_to) != block.size:
                    _fail(pool, f"live block 0x{block.ptr:x} size {block.size} != rounded "
                                f"requested {block.requested}")
                allocated += block.size
                live += 1
            seen[block.ptr] = block
            end = block.ptr + block.size
            prev = block
            block = block.next
        if end != base + nbytes:
            _fail(pool, f"blocks of segment 0x{base:x} end at 0x{end:x}, segment at 0x{base + nbytes:x}")
    if len(seen) != len(pool._blocks):
        _fail(pool, f"address index has {len(pool._blocks)} blocks, segments tile {len(seen)}")
    listed: set[tuple[int, int, int]] = set()
    for stream, arena in pool._arenas.items():
        if arena.sizes != sorted(arena.bins) or len(set(arena.sizes)) != len(arena.sizes):
            _fail(pool, f"arena {stream}: size list {arena.sizes} does not match bins")
        for size, ptrs in arena.bins.items():
            if not ptrs or ptrs != sorted(set(ptrs)):
                _fail(pool, f"arena {stream}: bin {size} is empty, unsorted or has duplicates")
            listed.update((stream, size, p) for p in ptrs)
    if listed != free:
        _fail(pool, f"free lists differ from free blocks: extra {sorted(listed - free)[:3]}, "
                    f"missing {sorted(free - listed)[:3]}")
    reserved = sum(pool._segments.values())
    spare = sum(pool._spares.values())
    if (pool._allocated, pool._reserved, pool._spare_bytes) != (allocated, reserved, spare):
        _fail(pool, f"counters allocated/reserved/spare = {pool._allocated}/{pool._reserved}/"
                    f"{pool._spare_bytes}, blocks say {allocated}/{reserved}/{spare}")
    if pool._num_mallocs - pool._num_frees != live:
        _fail(pool, f"num_mallocs - num_frees = {pool._num_mallocs - pool._num_frees}, live blocks {live}")
    if pool._peak_allocated < allocated or pool._peak_reserved < reserved:
        _fail(pool, "a peak counter is below the current value")
    for stream, (_, seq) in pool._pending.items():
        if seq > pool._num_frees:
            _fail(pool, f"pending event on stream {stream} has seq {seq} > pool num_frees {pool._num_frees}")

"""``Pool``: a best-fit, stream-aware caching allocator over integer addresses.

Layer A: pure Python, stdlib plus ``allocator.*``; must not import cgraw or anything CUDA.
Segments come from a ``SegmentSource``; sizes round up to ``round_to``; a block is split on
allocate (the remainder stays free just above it) and merged on free with neighbours free on
the *same* stream; each stream id has its own best-fit free lists (an ``Arena``). Cross-stream
reuse is in ``migration.py``, snapshot/restore and spare segments in ``snapshot.py``. Every
error (bad input, ``InvalidFree``, ``PoolExhausted``, ``SnapshotStale``) leaves state unchanged.
"""

from __future__ import annotations

import itertools
import operator
import threading
from bisect import bisect_left, bisect_right, insort
from dataclasses import dataclass

from allocator.bins import Arena, round_up
from allocator.block import Block
from allocator.errors import (
    AllocatorError,
    InvalidFree,
    PoolClosed,
    PoolExhausted,
    SnapshotMismatch,
    SnapshotStale,
    check_nbytes,
    check_positive,
    check_stream,
    fmt_bytes,
)
from allocator.migration import commit_migration, plan_migration
from allocator.snapshot import PoolSnapshot, RestoreDelta, apply_snapshot, take_snapshot
from allocator.source import SegmentSource, StreamEvents

_POOL_IDS = itertools.count(1)
_new_block = object.__new__
_NO_ARENA = Arena()  # always empty: stands in for a stream without free blocks


@dataclass(frozen=True)
class PoolStats:
    """A consistent view of a pool's counters (spare segments are counted apart)."""

    allocated_bytes: int
    reserved_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    live_blocks: int
    free_blocks: int
    segments: int
    spare_segments: int
    spare_bytes: int
    largest_free_block: int
    fragmentation: float
    limit: int | None
    num_mallocs: int
    num_frees: int


class Pool:
    """A caching allocator of integer address ranges, with per-stream free lists.

    Args:
        source: where segments come from (``reserve(nbytes) -> addr``, ``release(addr, nbytes)``).
        limit: the most bytes the pool may hold from the source (spares included), or None.
        round_to: every block size is a multiple of this.
        small_segment: segment size for requests <= ``small_threshold``.
        segment_round: larger requests get a segment of their size rounded up to this.
        small_threshold: the largest request served from small segments.
        events: enables cross-stream reuse (see ``allocator.migration``); None disables it.
        name: shown in error messages.

    All public methods are thread-safe: every mutation happens under ``_lock``.
    """

    def __init__(
        self,
        source: SegmentSource,
        *,
        limit: int | None = None,
        round_to: int = 512,
        small_segment: int = 2 << 20,
        segment_round: int = 2 << 20,
        small_threshold: int = 1 << 20,
        events: StreamEvents | None = None,
        name: str = "pool",
    ):
        if not (callable(getattr(source, "reserve", None)) and callable(getattr(source, "release", None))):
            raise TypeError(f"{source=} must have reserve(nbytes) and release(addr, nbytes) methods")
        if events is not None and not (callable(getattr(events, "record", None))
                                       and callable(getattr(events, "query", None))):
            raise TypeError(f"{events=} must be None or have record(stream_id) and query(token) methods")
        if limit is not None and (type(limit) is not int or limit < 0):
            raise ValueError(f"{limit=} must be None or an int >= 0")
        check_positive("round_to", round_to)
        for key, value in (("small_segment", small_segment), ("segment_round", segment_round)):
            check_positive(key, value)
            if value % round_to:
                raise ValueError(f"{key}={value} must be a multiple of {round_to=}")
        check_positive("small_threshold", small_threshold)
        if small_threshold > small_segment:
            raise ValueError(f"{small_threshold=} must be <= {small_segment=}")
        self.name = str(name)
        self.limit = limit
        self._source = source
        self._events = events
        self._round_to = round_to
        self._small_segment = small_segment
        self._segment_round = segment_round
        self._small_threshold = small_threshold
        self._uid = next(_POOL_IDS)
        # One lock guards every field below; public methods hold it for their whole body.
        self._lock = threading.Lock()
        self._closed = False
        self._blocks: dict[int, Block] = {}  # start address -> block, free or live, all segments
        self._arenas: dict[int, Arena] = {}  # stream id -> free lists; exactly the free blocks
        self._segments: dict[int, int] = {}  # base -> nbytes of bookkept segments
        self._seg_bases: list[int] = []  # sorted keys of _segments, for owns()
        self._spares: dict[int, int] = {}  # base -> nbytes: held from the source, not bookkept
        self._births: dict[int, int] = {}  # base -> reserve order, of every segment and spare
        self._reserve_count = itertools.count()
        self._pending: dict[int, tuple[object, int]] = {}  # stream -> (event token, seq stamp)
        self._allocated = 0
        self._reserved = 0
        self._spare_bytes = 0
        self._peak_allocated = 0
        self._peak_reserved = 0
        self._num_mallocs = 0
        self._num_frees = 0  # also the free sequence number: a block's seq is the value at its free

    # ------------------------------------------------------------------ hot path

    def malloc(self, nbytes: int, *, stream: int = 0) -> Block:
        """Allocate at least ``nbytes`` for use on ``stream``.

        Returns:
            A live ``Block``; ``size`` is ``nbytes`` rounded up to ``round_to``.

        Raises:
            TypeError, ValueError: ``nbytes`` is not a positive int, or ``stream`` not an int.
            PoolExhausted: the limit or the source cannot supply a new segment.
            PoolClosed: after ``close()``.
        """
        # Hot path: Arena.pop_best_fit/insert are inlined and the lock is taken with
        # acquire/release, which costs half of a ``with`` block on CPython 3.11.
        if type(nbytes) is not int or nbytes <= 0:
            nbytes = check_nbytes(nbytes)
        if type(stream) is not int:
            stream = check_stream(stream)
        round_to = self._round_to
        size = -(-nbytes // round_to) * round_to
        self._lock.acquire()
        try:
            blocks = self._blocks
            # A stream with no arena gets the shared empty one; close() empties _arenas, so
            # after close every malloc reaches the slow path, which raises PoolClosed.
            arena = self._arenas.get(stream, _NO_ARENA)
            try:
                sizes = arena.sizes
                i = bisect_left(sizes, size)
                found = sizes[i]  # IndexError: nothing big enough
                bins = arena.bins
                ptrs = bins[found]
                block = blocks[ptrs.pop(0)]
                if not ptrs:
                    del bins[found]
                    del sizes[i]
            except IndexError:  # nothing big enough on this stream
                block = None
            if block is None:
                block = self._acquire_slow(size, stream, nbytes)
                arena = self._arenas[stream]
                bins = arena.bins
            rest = block.size - size
            if rest:
                nxt = block.next
                ptr = block.ptr + size
                rem = _new_block(Block)  # Block(...) without the __init__ call: ~40% cheaper
                rem.ptr = ptr
                rem.size = rest
                rem.stream = stream
                rem.requested = 0
                rem.is_free = True
                rem.prev = block
                rem.next = nxt
                rem.seq = block.seq
                if nxt is not None:
                    nxt.prev = rem
                block.next = rem
                block.size = size
                blocks[ptr] = rem
                ptrs = bins.get(rest)
                if ptrs is None:
                    bins[rest] = [ptr]
                    insort(arena.sizes, rest)
                else:
                    insort(ptrs, ptr)
            block.is_free = False
            block.requested = nbytes
            allocated = self._allocated + size
            self._allocated = allocated
            if allocated > self._peak_allocated:
                self._peak_allocated = allocated
            self._num_mallocs += 1
            return block
        finally:
            self._lock.release()

    def free(self, block_or_ptr: Block | int, *, stream: int | None = None) -> None:
        """Return a live block to the pool, merging it with neighbours free on the same stream.

        Args:
            block_or_ptr: a ``Block`` from ``malloc`` or its ``ptr``; either way the block is
                looked up by address, so a handle from before a ``restore`` still works.
            stream: the stream that last used the block; defaults to the block's stream.

        Raises:
            InvalidFree: double free, or an address that is not a live block of this pool.
            PoolClosed: after ``close()``.
        """
        if type(block_or_ptr) is Block:
            ptr = block_or_ptr.ptr
        elif type(block_or_ptr) is int:
            ptr = block_or_ptr
        else:
            ptr = self._check_ptr(block_or_ptr)
        if stream is not None and type(stream) is not int:
            stream = check_stream(stream)
        self._lock.acquire()
        try:
            blocks = self._blocks
            block = blocks.get(ptr)
            if block is None or block.is_free:
                raise self._invalid_free(ptr)  # also covers close(), which empties _blocks
            if stream is None:
                stream = block.stream
            self._allocated -= block.size
            seq = self._num_frees = self._num_frees + 1
            block.is_free = True
            block.requested = 0
            block.stream = stream
            block.seq = seq
            arena = self._arenas.get(stream)
            if arena is None:
                arena = self._arenas[stream] = Arena()
            # migration.merge_insert, inlined (a free's seq is the newest, so merged blocks take it).
            bins = arena.bins
            prev = block.prev
            if prev is not None and prev.is_free and prev.stream == stream:
                psize = prev.size
                ptrs = bins[psize]
                if len(ptrs) == 1:
                    del bins[psize]
                    sizes = arena.sizes
                    del sizes[bisect_left(sizes, psize)]
                else:
                    del ptrs[bisect_left(ptrs, prev.ptr)]
                del blocks[ptr]
                prev.size = psize + block.size
                nxt = prev.next = block.next
                if nxt is not None:
                    nxt.prev = prev
                prev.seq = seq
                block = prev
            nxt = block.next
            if nxt is not None and nxt.is_free and nxt.stream == stream:
                nsize = nxt.size
                ptrs = bins[nsize]
                if len(ptrs) == 1:
                    del bins[nsize]
                    sizes = arena.sizes
                    del sizes[bisect_left(sizes, nsize)]
                else:
                    del ptrs[bisect_left(ptrs, nxt.ptr)]
                del blocks[nxt.ptr]
                block.size += nsize
                after = block.next = nxt.next
                if after is not None:
                    after.prev = block
            size = block.size
            ptrs = bins.get(size)
            if ptrs is None:
                bins[size] = [block.ptr]
                insort(arena.sizes, size)
            else:
                insort(ptrs, block.ptr)
        finally:
            self._lock.release()

    # ------------------------------------------------------------------ slow path

    def _acquire_slow(self, size: int, stream: int, nbytes: int) -> Block:
        """A free block of >= ``size`` on ``stream``, not filed in any arena. Commits nothing
        before the last point where it can raise."""
        if self._closed:
            raise PoolClosed(f"pool {self.name!r}: malloc after close()")
        plan = None
        if self._events is not None:
            plan = plan_migration(self, stream, size)
            if plan is not None and plan.fits:
                commit_migration(self, plan, stream)
                return self._blocks[self._arenas[stream].pop_best_fit(size)]
        block = self._new_segment(size, stream, nbytes)
        if plan is not None:
            commit_migration(self, plan, stream)
        if stream not in self._arenas:
            self._arenas[stream] = Arena()
        return block

    def _segment_size(self, size: int) -> int:
        if size <= self._small_threshold:
            return self._small_segment
        return round_up(size, self._segment_round)

    def _new_segment(self, size: int, stream: int, nbytes: int) -> Block:
        """A fresh whole-segment free block: a spare if one is big enough, else from the source."""
        seg_size = self._segment_size(size)
        # The earliest-reserved spare that is big enough: a replay after restore() then meets
        # the spares in the order the first run reserved them and gets the same pointers.
        births = self._births
        fitting = [(births[b], b) for b, s in self._spares.items() if s >= seg_size]
        if fitting:
            base = min(fitting)[1]
            seg_size = self._spares.pop(base)
            self._spare_bytes -= seg_size
            to_release = []
        else:
            base, to_release = self._reserve(seg_size, nbytes)
        self._segments[base] = seg_size
        insort(self._seg_bases, base)
        block = Block(base, seg_size, stream, 0, True, None, None, 0)
        self._blocks[base] = block
        self._reserved += seg_size
        for kind, b, s in to_release:  # the limit path's room-making, now that reserve worked
            if kind == "spare":
                del self._spares[b]
                del self._births[b]
                self._spare_bytes -= s
                self._source.release(b, s)
            else:
                self._release_segment(b, s)
        if self._reserved > self._peak_reserved:
            self._peak_reserved = self._reserved
        return block

    def _empty_segments(self) -> list[tuple[int, int]]:
        """(base, nbytes) of bookkept segments that are one free block, not on a pinned stream."""
        out = []
        pinned = self._pinned_streams()
        for base, nbytes in self._segments.items():
            b = self._blocks[base]
            if b.is_free and b.next is None and b.stream not in pinned:
                out.append((base, nbytes))
        return out

    def _pinned_streams(self):
        """Streams whose free blocks neither move to other streams nor go back to the source
        (``trim``, the limit path). None here; a subclass pins the streams of work that still
        uses freed memory (``cgraw.DevicePool``: a live graph's capture stream). Called under
        ``_lock``, off the hot path."""
        return ()

    def _reserve(self, seg_size: int, nbytes: int) -> tuple[int, list[tuple[str, int, int]]]:
        """Reserve a segment from the source within the limit; return its base and the spare or
        empty segments that must then be released to stay under the limit."""
        held = self._reserved + self._spare_bytes
        limit = self.limit
        to_release: list[tuple[str, int, int]] = []
        if limit is not None and held + seg_size > limit:
            candidates = [("spare", b, s) for b, s in self._spares.items()]
            candidates.sort(key=lambda c: (-c[2], c[1]))
            empties = [("segment", b, s) for b, s in self._empty_segments()]
            empties.sort(key=lambda c: (-c[2], c[1]))
            over = held + seg_size - limit
            for cand in candidates + empties:
                if over <= 0:
                    break
                to_release.append(cand)
                over -= cand[2]
            if over > 0:
                raise PoolExhausted(
                    f"pool {self.name!r}: cannot allocate {fmt_bytes(nbytes)} (needs a new "
                    f"{fmt_bytes(seg_size)} segment): {fmt_bytes(held)} reserved, limit "
                    f"{fmt_bytes(limit)}; free memory or raise limit=",
                    requested=nbytes, in_use=held, limit=limit,
                )
        try:
            base = self._source.reserve(seg_size)
        except MemoryError as exc:
            cached = self._spare_bytes + sum(s for _, s in self._empty_segments())
            hint = f"; trim() would release {fmt_bytes(cached)}" if cached else ""
            raise PoolExhausted(
                f"pool {self.name!r}: cannot allocate {fmt_bytes(nbytes)}: the source could not "
                f"reserve a {fmt_bytes(seg_size)} segment ({fmt_bytes(held)} reserved){hint}",
                requested=nbytes, in_use=held, limit=limit,
            ) from exc
        if type(base) is not int:
            base = operator.index(base)
        if base in self._segments or base in self._spares:
            raise AllocatorError(
                f"pool {self.name!r}: source returned 0x{base:x}, which the pool already holds")
        self._births[base] = next(self._reserve_count)
        return base, to_release

    def _release_segment(self, base: int, nbytes: int) -> None:
        """Drop an all-free, unsplit segment from the bookkeeping and give it to the source."""
        block = self._blocks.pop(base)
        self._arenas[block.stream].remove(block.size, base)
        del self._segments[base]
        del self._births[base]
        del self._seg_bases[bisect_right(self._seg_bases, base) - 1]
        self._reserved -= nbytes
        self._source.release(base, nbytes)

    # ------------------------------------------------------------------ errors

    def _check_ptr(self, obj: object) -> int:
        ptr = getattr(obj, "ptr", obj)
        if isinstance(ptr, bool):
            raise TypeError(f"block_or_ptr={obj!r} must be a Block or an int address")
        try:
            return operator.index(ptr)
        except TypeError:
            raise TypeError(f"block_or_ptr={obj!r} must be a Block or an int address") from None

    def _invalid_free(self, ptr: int) -> AllocatorError:
        if self._closed:
            return PoolClosed(f"pool {self.name!r}: free of ptr=0x{ptr:x} after close()")
        block = self._blocks.get(ptr)
        where = f"pool {self.name!r}: free of ptr=0x{ptr:x}"
        if block is not None:
            return InvalidFree(f"{where}: double free (the block is already free)")
        if self._owns_locked(ptr):
            return InvalidFree(f"{where}: not the start of a live block")
        if any(b <= ptr < b + s for b, s in self._spares.items()):
            return InvalidFree(f"{where}: lies in a spare segment (not live since a restore())")
        return InvalidFree(f"{where}: not owned by this pool")

    # ------------------------------------------------------------------ queries

    def _owns_locked(self, ptr: int) -> bool:
        i = bisect_right(self._seg_bases, ptr) - 1
        if i < 0:
            return False
        base = self._seg_bases[i]
        return ptr < base + self._segments[base]

    def owns(self, ptr: int) -> bool:
        """Whether ``ptr`` lies in one of the pool's bookkept segments (spares excluded)."""
        with self._lock:
            return self._owns_locked(ptr)

    def segment_ranges(self) -> list[tuple[int, int]]:
        """``(base, bytes)`` of the pool's bookkept segments, by address (spares excluded)."""
        with self._lock:
            return [(b, self._segments[b]) for b in self._seg_bases]

    def block_at(self, ptr: int) -> Block | None:
        """The live block starting at ``ptr``, or None."""
        with self._lock:
            block = self._blocks.get(ptr)
            return None if block is None or block.is_free else block

    def live_blocks(self) -> list[Block]:
        """Every live block, by address."""
        with self._lock:
            return sorted((b for b in self._blocks.values() if not b.is_free), key=lambda b: b.ptr)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has been called."""
        return self._closed

    def stats(self) -> PoolStats:
        """The pool's counters, read under the lock."""
        with self._lock:
            free_blocks = sum(len(a) for a in self._arenas.values())
            largest = max((a.largest for a in self._arenas.values()), default=0)
            total_free = self._reserved - self._allocated
            return PoolStats(
                allocated_bytes=self._allocated,
                reserved_bytes=self._reserved,
                peak_allocated_bytes=self._peak_allocated,
                peak_reserved_bytes=self._peak_reserved,
                live_blocks=0 if self._closed else self._num_mallocs - self._num_frees,
                free_blocks=free_blocks,
                segments=len(self._segments),
                spare_segments=len(self._spares),
                spare_bytes=self._spare_bytes,
                largest_free_block=largest,
                fragmentation=1.0 - largest / total_free if total_free else 0.0,
                limit=self.limit,
                num_mallocs=self._num_mallocs,
                num_frees=self._num_frees,
            )

    # ------------------------------------------------------------------ snapshot / restore

    def snapshot(self) -> PoolSnapshot:
        """An immutable record of the bookkeeping, for ``restore``. O(blocks); copies no memory.

        Raises:
            PoolClosed: after ``close()``.
        """
        with self._lock:
            if self._closed:
                raise PoolClosed(f"pool {self.name!r}: snapshot after close()")
            return take_snapshot(self)

    def restore(self, snap: PoolSnapshot) -> RestoreDelta:
        """Make the bookkeeping exactly ``snap``'s. O(blocks).

        Segments held now but absent from ``snap`` become spare; segments of ``snap`` that are
        spare now are taken back. Live ``Block`` handles of blocks live in both states stay valid.

        Returns:
            The live ``(ptr, size)`` ranges that the restore freed and revived.

        Raises:
            SnapshotMismatch: ``snap`` was taken from another pool.
            SnapshotStale: a segment of ``snap`` has been released to the source since.
            PoolClosed: after ``close()``.
        """
        if not isinstance(snap, PoolSnapshot):
            raise TypeError(f"snap={snap!r} must be a PoolSnapshot")
        with self._lock:
            if self._closed:
                raise PoolClosed(f"pool {self.name!r}: restore after close()")
            if snap.pool_id != self._uid:
                raise SnapshotMismatch(
                    f"pool {self.name!r} (id {self._uid}): snapshot was taken from pool id {snap.pool_id}")
            missing = [s for s in snap.segments
                       if self._segments.get(s.base) != s.nbytes and self._spares.get(s.base) != s.nbytes]
            if missing:
                seg = missing[0]
                others = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
                raise SnapshotStale(
                    f"pool {self.name!r}: cannot restore: segment 0x{seg.base:x} ({fmt_bytes(seg.nbytes)})"
                    f"{others} released to the source since the snapshot (by trim() or the limit); "
                    f"trim only when no snapshot that needs them will be restored")
            return apply_snapshot(self, snap)

    # ------------------------------------------------------------------ giving memory back

    def trim(self) -> int:
        """Release every unsplit all-free segment and every spare segment to the source.

        Returns:
            Bytes released (0 after ``close()``).
        """
        with self._lock:
            if self._closed:
                return 0
            released = 0
            for base, nbytes in self._empty_segments():
                self._release_segment(base, nbytes)
                released += nbytes
            for base, nbytes in sorted(self._spares.items()):
                del self._spares[base]
                del self._births[base]
                self._spare_bytes -= nbytes
                self._source.release(base, nbytes)
                released += nbytes
            return released

    def close(self) -> None:
        """Release every segment, live blocks included, and every spare. Idempotent.

        Later ``malloc``/``free``/``snapshot``/``restore`` raise ``PoolClosed``. If a release
        fails, the others are still attempted and the first error is raised.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            held = sorted(self._segments.items()) + sorted(self._spares.items())
            self._blocks, self._arenas, self._segments, self._seg_bases = {}, {}, {}, []
            self._spares, self._pending, self._births = {}, {}, {}
            self._allocated = self._reserved = self._spare_bytes = 0
            first_error = None
            for base, nbytes in held:
                try:
                    self._source.release(base, nbytes)
                except Exception as exc:  # keep releasing the rest
                    if first_error is None:
                        first_error = exc
            if first_error is not None:
                raise first_error

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else (
            f"allocated={self._allocated}, reserved={self._reserved}, segments={len(self._segments)}")
        return f"Pool(name={self.name!r}, {state})"

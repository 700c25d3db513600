"""Unit tests of ``allocator.Pool`` on ``IntRangeSource``: no GPU, no cgraw, no CUDA."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
from pool_helpers import FakeEvents, NoRecordEvents, segment_blocks

from allocator import (
    AllocatorError,
    IntRangeSource,
    InvalidFree,
    InvariantError,
    Pool,
    PoolClosed,
    PoolExhausted,
    SnapshotMismatch,
    SnapshotStale,
    check_invariants,
)

MiB = 1 << 20
SEG = 2 * MiB  # default small segment


@pytest.fixture
def source():
    return IntRangeSource()


@pytest.fixture
def pool(source):
    p = Pool(source, name="t")
    yield p
    check_invariants(p)
    p.close()
    assert source.reserved_bytes == 0


def blocks(pool):
    """(ptr, size, is_free, stream) of every block, by address."""
    return [(b.ptr, b.size, b.is_free, b.stream) for b in pool.snapshot().blocks]


# ---------------------------------------------------------------- rounding, split, merge


@pytest.mark.parametrize(("nbytes", "size"), [(1, 512), (511, 512), (512, 512), (513, 1024), (3000, 3072)])
def test_sizes_round_up_to_512(pool, nbytes, size):
    block = pool.malloc(nbytes)
    assert (block.size, block.requested, block.stream) == (size, nbytes, 0)
    assert block.ptr % 512 == 0


def test_split_leaves_remainder_free_just_above(pool, source):
    a = pool.malloc(1000)
    (base, nbytes), = source.live_segments.items()
    assert (a.ptr, nbytes) == (base, SEG)
    assert blocks(pool) == [(base, 1024, False, 0), (base + 1024, SEG - 1024, True, 0)]
    b = pool.malloc(5000)
    assert b.ptr == base + 1024
    assert blocks(pool)[-1] == (base + 1024 + 5120, SEG - 1024 - 5120, True, 0)


@pytest.mark.parametrize("order", ["ab", "ba"])
def test_freeing_both_halves_merges_back_to_the_segment(pool, order):
    a = pool.malloc(4096)
    b = pool.malloc(8192)
    c = pool.malloc(512)  # keeps b from merging with the tail
    for name in order:
        pool.free({"a": a, "b": b}[name])
    base = a.ptr
    assert blocks(pool)[:2] == [(base, 4096 + 8192, True, 0), (c.ptr, 512, False, 0)]
    pool.free(c)
    assert blocks(pool) == [(base, SEG, True, 0)]


def test_best_fit_takes_smallest_fitting_block_then_lowest_address(pool):
    sizes = [4096, 2048, 3072, 2048, 8192]
    holes = []
    for size in sizes:
        holes.append(pool.malloc(size))
        pool.malloc(512)  # a live separator, so the holes never merge
    ptrs = [h.ptr for h in holes]
    for h in holes:
        pool.free(h)
    assert pool.malloc(2048).ptr == ptrs[1]  # two 2 KiB holes: the lower one
    assert pool.malloc(2500).ptr == ptrs[2]  # 3 KiB is the smallest that fits
    assert pool.malloc(1000).ptr == ptrs[3]  # the other 2 KiB hole beats the 4 KiB one
    big = pool.malloc(4097)
    assert big.ptr == ptrs[4]  # 8 KiB hole, split
    assert pool.block_at(ptrs[4]) is big and big.size == 4608


def test_large_request_gets_its_own_rounded_segment(pool, source):
    block = pool.malloc(3 * MiB + 1)
    assert block.size == 3 * MiB + 512
    assert sorted(source.live_segments.values()) == [4 * MiB]
    assert pool.stats().largest_free_block == 4 * MiB - block.size


def test_segments_over_one_gib(pool, source):
    block = pool.malloc((3 << 30) + 1)
    assert block.size == (3 << 30) + 512
    assert source.reserved_bytes == (3 << 30) + SEG
    small = pool.malloc(100)  # served from the 1 GiB segment's tail
    assert small.ptr == block.ptr + block.size
    pool.free(block)
    pool.free(small)
    assert pool.trim() == (3 << 30) + SEG
    assert source.reserved_bytes == 0


# ---------------------------------------------------------------- streams


def test_streams_are_isolated_without_events(pool, source):
    a = pool.malloc(1000, stream=1)
    pool.free(a)
    b = pool.malloc(1000, stream=2)
    assert b.ptr != a.ptr and pool.stats().segments == 2
    assert pool.malloc(1000, stream=1).ptr == a.ptr  # same stream: reused


def test_free_on_another_stream_files_the_block_there(pool):
    a = pool.malloc(1000, stream=1)
    b = pool.malloc(1000, stream=1)
    pool.free(a, stream=2)
    assert pool.malloc(1000, stream=2).ptr == a.ptr
    pool.free(b)


def test_neighbours_free_on_different_streams_do_not_merge(pool):
    a = pool.malloc(1024)
    b = pool.malloc(1024)
    pool.free(a, stream=7)
    pool.free(b)
    assert blocks(pool) == [(a.ptr, 1024, True, 7), (b.ptr, SEG - 1024, True, 0)]


def test_cross_stream_reuse_waits_for_the_event(source):
    events = FakeEvents()
    pool = Pool(source, events=events)
    a = pool.malloc(SEG, stream=0)  # exactly one whole segment
    events.launch(0)  # work on stream 0 still uses a
    pool.free(a)
    b = pool.malloc(SEG, stream=1)
    assert b.ptr != a.ptr  # event recorded, not done: grow instead
    assert events.recorded == [(0, 1)]
    snap = pool.snapshot()
    assert [(p.stream, p.token) for p in snap.pending] == [(0, (0, 1))]
    events.finish(0)
    c = pool.malloc(SEG, stream=1)
    assert (c.ptr, c.stream) == (a.ptr, 1)
    assert pool.snapshot().pending == ()
    assert source.num_reserves == 2
    check_invariants(pool)


def test_cross_stream_event_covers_only_frees_before_it(source):
    events = FakeEvents()
    pool = Pool(source, events=events)
    a1 = pool.malloc(SEG)
    a2 = pool.malloc(SEG)
    events.launch(0)
    pool.free(a1)
    pool.malloc(SEG, stream=1)  # miss: records the event covering a1 only
    pool.free(a2)  # freed after the record
    events.finish(0)
    assert pool.malloc(SEG, stream=1).ptr == a1.ptr
    assert [(b.ptr, b.stream) for b in pool.snapshot().blocks if b.is_free] == [(a2.ptr, 0)]
    assert pool.malloc(SEG, stream=1).ptr == a2.ptr  # a new event, done at once
    assert source.num_reserves == 3
    check_invariants(pool)


def test_migrated_block_merges_with_target_stream_neighbour(source):
    events = FakeEvents()
    pool = Pool(source, events=events)
    a = pool.malloc(MiB)
    b = pool.malloc(MiB)  # a and b tile one segment
    pool.free(a, stream=1)
    pool.free(b, stream=0)
    events.launch(0)
    c = pool.malloc(SEG, stream=1)  # a alone is too small; b is not yet reusable
    assert c.ptr not in (a.ptr, b.ptr)
    events.finish(0)
    pool.free(c)
    d = pool.malloc(SEG + 512, stream=1)  # needs a bigger block: misses, moves b, merges a+b
    assert pool.snapshot().blocks[0][:4] == (a.ptr, SEG, True, 1)
    assert d.ptr not in (a.ptr, c.ptr)
    check_invariants(pool)


def test_events_that_cannot_record_disable_reuse(source):
    pool = Pool(source, events=NoRecordEvents())
    a = pool.malloc(SEG)
    pool.free(a)
    assert pool.malloc(SEG, stream=1).ptr != a.ptr
    assert pool.snapshot().pending == ()


# ---------------------------------------------------------------- limit and source failures


def test_limit_raises_pool_exhausted_with_figures(source):
    pool = Pool(source, limit=64 * MiB, name="x")
    for _ in range(31):
        pool.malloc(SEG)
    snap = pool.snapshot()
    with pytest.raises(PoolExhausted) as info:
        pool.malloc(3 * MiB)
    err = info.value
    assert (err.requested, err.in_use, err.limit) == (3 * MiB, 62 * MiB, 64 * MiB)
    assert isinstance(err, MemoryError)
    assert "pool 'x': cannot allocate 3.0 MiB" in str(err)
    assert "62.0 MiB reserved, limit 64.0 MiB; free memory or raise limit=" in str(err)
    assert pool.snapshot() == snap
    assert source.reserved_bytes == 62 * MiB


def test_limit_releases_empty_segments_when_that_makes_room(source):
    pool = Pool(source, limit=2 * SEG)
    a = pool.malloc(SEG, stream=0)
    pool.malloc(SEG, stream=0)
    pool.free(a)  # an empty segment on stream 0, useless to stream 1 without events
    b = pool.malloc(SEG, stream=1)
    assert source.num_releases == 1 and source.reserved_bytes == 2 * SEG
    assert b.ptr != a.ptr
    check_invariants(pool)


def test_limit_does_not_release_when_that_would_not_help(source):
    pool = Pool(source, limit=2 * SEG)
    a = pool.malloc(SEG)
    pool.free(a)
    snap = pool.snapshot()
    with pytest.raises(PoolExhausted):
        pool.malloc(3 * SEG, stream=1)  # needs 3 segments' worth even with the empty one gone
    assert source.num_releases == 0 and pool.snapshot() == snap


def test_source_memory_error_becomes_pool_exhausted(source):
    source = IntRangeSource(capacity=SEG)
    pool = Pool(source)
    pool.malloc(SEG)
    snap = pool.snapshot()
    with pytest.raises(PoolExhausted) as info:
        pool.malloc(1)
    assert isinstance(info.value.__cause__, MemoryError)
    assert info.value.requested == 1 and info.value.limit is None
    assert pool.snapshot() == snap


def test_failed_malloc_with_events_leaves_pending_state_unchanged(source):
    events = FakeEvents()
    pool = Pool(source, events=events, limit=SEG)
    a = pool.malloc(MiB)
    pool.malloc(512)  # keeps the segment in use, so the limit path cannot release it
    events.launch(0)
    pool.free(a)
    snap = pool.snapshot()
    with pytest.raises(PoolExhausted):
        pool.malloc(SEG, stream=1)
    assert events.recorded == [(0, 1)]
    assert pool.snapshot() == snap  # the event recorded on the way is not kept


# ---------------------------------------------------------------- bad input


def _live_pool(source):
    pool = Pool(source, name="bad")
    a = pool.malloc(1000)
    b = pool.malloc(2000)
    pool.free(b)
    return pool, a, b


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda p, a, b: p.malloc(0), ValueError, "nbytes=0 must be > 0"),
        (lambda p, a, b: p.malloc(-5), ValueError, "nbytes=-5"),
        (lambda p, a, b: p.malloc(1.5), TypeError, "nbytes=1.5"),
        (lambda p, a, b: p.malloc("64"), TypeError, "nbytes='64'"),
        (lambda p, a, b: p.malloc(True), TypeError, "nbytes=True"),
        (lambda p, a, b: p.malloc(64, stream="s"), TypeError, "stream='s'"),
        (lambda p, a, b: p.free(b), InvalidFree, "double free"),
        (lambda p, a, b: p.free(b.ptr), InvalidFree, r"0x[0-9a-f]+"),
        (lambda p, a, b: p.free(a.ptr + 512), InvalidFree, "not the start of a live block"),
        (lambda p, a, b: p.free(0x1234), InvalidFree, "0x1234: not owned"),
        (lambda p, a, b: p.free(None), TypeError, "block_or_ptr=None"),
        (lambda p, a, b: p.free(a, stream=1.0), TypeError, "stream=1.0"),
        (lambda p, a, b: p.restore("snap"), TypeError, "must be a PoolSnapshot"),
    ],
)
def test_bad_input_raises_and_changes_nothing(source, call, exc, match):
    pool, a, b = _live_pool(source)
    snap = pool.snapshot()
    with pytest.raises(exc, match=match):
        call(pool, a, b)
    assert pool.snapshot() == snap
    check_invariants(pool)


def test_double_free_message_names_pointer_in_hex(source):
    pool, a, b = _live_pool(source)
    with pytest.raises(InvalidFree, match=f"ptr=0x{b.ptr:x}"):
        pool.free(b)


def test_restore_of_another_pools_snapshot(source):
    pool, _, _ = _live_pool(source)
    other = Pool(IntRangeSource())
    other.malloc(10)
    snap = pool.snapshot()
    with pytest.raises(SnapshotMismatch):
        pool.restore(other.snapshot())
    assert pool.snapshot() == snap


@pytest.mark.parametrize(
    "kwargs",
    [
        {"round_to": 0},
        {"limit": -1},
        {"small_segment": 1000},
        {"segment_round": 3 << 9, "round_to": 1024},
        {"small_threshold": 4 * MiB},
        {"small_threshold": 0},
    ],
)
def test_bad_constructor_arguments(source, kwargs):
    with pytest.raises(ValueError):
        Pool(source, **kwargs)


def test_source_and_events_are_checked_at_construction(source):
    with pytest.raises(TypeError, match="source="):
        Pool(object())
    with pytest.raises(TypeError, match="events="):
        Pool(source, events=object())


# ---------------------------------------------------------------- trim, close, stats


def test_trim_releases_only_unsplit_free_segments_and_spares(source):
    pool = Pool(source)
    keep = pool.malloc(1000)  # segment 1 stays (live block)
    empty = pool.malloc(3 * MiB)  # segment 2 (4 MiB) becomes all free
    pool.free(empty)
    split = pool.malloc(SEG, stream=1)  # segment 3: all free, but split across two streams
    pool.free(split)
    s1 = pool.malloc(1024, stream=1)
    pool.free(s1, stream=2)
    snap = pool.snapshot()
    pool.malloc(8 * MiB)  # segment 4, spare after the restore
    pool.restore(snap)
    assert pool.stats().spare_segments == 1
    assert pool.trim() == 4 * MiB + 8 * MiB
    assert pool.stats().spare_bytes == 0 and pool.stats().segments == 2
    assert source.reserved_bytes == 2 * SEG
    assert pool.block_at(keep.ptr) is keep
    check_invariants(pool)


def test_close_releases_everything_and_is_idempotent(source):
    pool = Pool(source)
    pool.malloc(1000)
    pool.malloc(5 * MiB)
    snap = pool.snapshot()
    pool.malloc(SEG)
    pool.restore(snap)  # one spare
    pool.close()
    pool.close()
    assert pool.closed and source.reserved_bytes == 0 and source.live_segments == {}
    with pytest.raises(PoolClosed):
        pool.malloc(1)
    with pytest.raises(PoolClosed):
        pool.free(snap.blocks[0].ptr)
    with pytest.raises(PoolClosed):
        pool.snapshot()
    with pytest.raises(PoolClosed):
        pool.restore(snap)
    assert pool.trim() == 0
    assert pool.stats().reserved_bytes == 0 and pool.stats().live_blocks == 0
    check_invariants(pool)


def test_context_manager_closes(source):
    with Pool(source) as pool:
        pool.malloc(10)
    assert pool.closed and source.reserved_bytes == 0


def test_stats_add_up(source):
    pool = Pool(source, limit=1 << 30)
    a = pool.malloc(1000)  # 1024
    b = pool.malloc(3 * MiB)  # own 4 MiB segment
    c = pool.malloc(512)
    assert c.ptr == b.ptr + b.size  # best fit: the 1 MiB tail beats the 2 MiB one
    pool.free(a)  # segment 1 is whole and free again
    st = pool.stats()
    assert st.allocated_bytes == 3 * MiB + 512
    assert st.reserved_bytes == SEG + 4 * MiB == source.reserved_bytes
    assert st.peak_allocated_bytes == 1024 + 3 * MiB + 512
    assert st.peak_reserved_bytes == SEG + 4 * MiB
    assert (st.live_blocks, st.free_blocks, st.segments) == (2, 2, 2)
    total_free = st.reserved_bytes - st.allocated_bytes
    largest = SEG
    assert st.largest_free_block == largest
    assert st.fragmentation == pytest.approx(1 - largest / total_free)
    assert (st.limit, st.num_mallocs, st.num_frees) == (1 << 30, 3, 1)
    assert (st.spare_segments, st.spare_bytes) == (0, 0)
    pool.free(b)
    pool.free(c)
    st = pool.stats()
    assert st.allocated_bytes == 0 and st.peak_allocated_bytes == 1024 + 3 * MiB + 512
    assert st.fragmentation == pytest.approx(1 - (4 * MiB) / (6 * MiB))


def test_empty_pool_stats(pool):
    st = pool.stats()
    assert (st.allocated_bytes, st.reserved_bytes, st.free_blocks, st.fragmentation) == (0, 0, 0, 0.0)


def test_owns_block_at_live_blocks(pool):
    a = pool.malloc(1000)
    b = pool.malloc(1000)
    pool.free(a)
    assert pool.owns(a.ptr) and pool.owns(b.ptr + 10) and not pool.owns(0)
    assert pool.block_at(b.ptr) is b and pool.block_at(a.ptr) is None
    assert pool.live_blocks() == [b]


# ---------------------------------------------------------------- snapshot and restore


def test_restore_delta_and_exact_state(pool):
    a = pool.malloc(1000)
    b = pool.malloc(2000)
    snap = pool.snapshot()
    pool.free(a)
    c = pool.malloc(3 * MiB)
    delta = pool.restore(snap)
    assert delta.became_free == ((c.ptr, c.size),)
    assert delta.became_live == ((a.ptr, a.size),)
    assert pool.snapshot() == snap
    assert [x.ptr for x in pool.live_blocks()] == [a.ptr, b.ptr]
    assert pool.block_at(b.ptr) is b  # a handle live on both sides is kept
    pool.free(a)  # a stale handle (freed before the restore) frees by address
    pool.free(b.ptr)


def test_snapshot_is_an_immutable_value(pool):
    pool.malloc(1000)
    s1 = pool.snapshot()
    s2 = pool.snapshot()
    assert s1 == s2 and s1 is not s2
    with pytest.raises(AttributeError):
        s1.blocks = ()
    assert isinstance(s1.blocks, tuple) and s1.allocated_bytes == 1024 and s1.reserved_bytes == SEG


def test_spare_segments_replay_identical_pointers(source):
    pool = Pool(source)
    pool.malloc(1000)
    snap = pool.snapshot()
    ops = [(SEG, 0), (100, 1), (5 * MiB, 0), (700 * 1024, 2), (3 * MiB, 1), (SEG, 0)]
    first = [pool.malloc(n, stream=s).ptr for n, s in ops]
    reserves = source.num_reserves
    held = source.reserved_bytes
    pool.restore(snap)
    st = pool.stats()
    assert st.reserved_bytes == SEG and st.segments == 1
    assert st.spare_bytes == held - SEG and st.spare_segments == reserves - 1
    again = [pool.malloc(n, stream=s).ptr for n, s in ops]
    assert again == first
    assert source.num_reserves == reserves  # every segment came back from the spares
    assert pool.stats().spare_segments == 0


def test_replay_takes_spares_in_reserve_order_not_smallest_first(pool):
    empty = pool.snapshot()
    pool.malloc(5 * MiB)  # a 6 MiB segment
    pool.restore(empty)
    assert pool.stats().spare_bytes == 6 * MiB
    snap = pool.snapshot()
    ops = [3 * MiB + 1, 3 * MiB - 1]  # 4 MiB segments: the 6 MiB spare, then a new 4 MiB one
    first = [pool.malloc(n).ptr for n in ops]
    pool.restore(snap)  # spares: 6 MiB (older) and 4 MiB (newer)
    assert [pool.malloc(n).ptr for n in ops] == first  # smallest-first would take the 4 MiB


def test_restore_takes_segments_back_from_spare(pool):
    snap0 = pool.snapshot()
    a = pool.malloc(1000)
    snap1 = pool.snapshot()
    pool.restore(snap0)
    assert pool.stats().spare_segments == 1 and pool.stats().segments == 0
    with pytest.raises(InvalidFree, match="spare segment"):
        pool.free(a)
    pool.restore(snap1)
    assert pool.stats().spare_segments == 0 and pool.snapshot() == snap1
    pool.free(a)


def test_restore_after_trim_released_its_segment(pool):
    a = pool.malloc(1000)
    snap = pool.snapshot()
    pool.free(a)
    pool.trim()
    now = pool.snapshot()
    with pytest.raises(SnapshotStale, match="released to the source"):
        pool.restore(snap)
    assert isinstance(SnapshotStale("x"), AllocatorError)
    assert pool.snapshot() == now


def test_restore_brings_back_pending_events(source):
    events = FakeEvents()
    pool = Pool(source, events=events)
    a = pool.malloc(SEG)
    events.launch(0)
    pool.free(a)
    pool.malloc(SEG, stream=1)
    snap = pool.snapshot()
    assert len(snap.pending) == 1
    events.finish(0)
    assert pool.malloc(SEG, stream=1).ptr == a.ptr
    pool.restore(snap)
    assert pool.snapshot() == snap
    assert pool.malloc(SEG, stream=1).ptr == a.ptr  # the restored event is done now


def test_segment_walk_helper(pool):
    pool.malloc(1000)
    pool.malloc(3 * MiB)
    per_segment = segment_blocks(pool.snapshot())
    assert sorted(len(v) for v in per_segment.values()) == [2, 2]


# ---------------------------------------------------------------- checker, threads, layering


def test_check_invariants_catches_corruption(pool):
    a = pool.malloc(1000)
    pool.malloc(1000)
    a.size += 512  # overlaps its neighbour now
    with pytest.raises(InvariantError) as info:
        check_invariants(pool)
    assert isinstance(info.value, AssertionError)
    a.size -= 512


def test_threads_share_one_pool(pool):
    def work(stream):
        for i in range(300):
            b = pool.malloc(512 * (1 + (i * 7919 + stream) % 64), stream=stream)
            pool.free(b)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    st = pool.stats()
    assert st.allocated_bytes == 0 and st.num_mallocs == st.num_frees == 1200


def test_int_range_source_contract():
    src = IntRangeSource(capacity=3 * SEG, base=1 << 40, alignment=4096)
    a = src.reserve(1000)
    b = src.reserve(SEG)
    assert a == 1 << 40 and b % 4096 == 0 and b >= a + 1000
    src.release(a, 1000)
    assert src.reserve(1000) > b  # addresses are never reused
    with pytest.raises(MemoryError):
        src.reserve(2 * SEG)
    with pytest.raises(InvalidFree, match="double release"):
        src.release(a, 1000)
    with pytest.raises(InvalidFree):
        src.release(b, 1)
    with pytest.raises(InvalidFree):
        src.release(12345, 1)
    assert src.reserved_bytes == SEG + 1000 and len(src.live_segments) == 2


def test_allocator_imports_no_cgraw_and_no_cuda():
    code = (
        # cuda-bindings 12.9's .pth file imports the ``cuda`` namespace at start-up: only new modules count
        "import sys\nbefore = set(sys.modules)\nimport allocator\n"
        "bad = [m for m in set(sys.modules) - before if m.split('.')[0] in ('cgraw', 'cuda', 'numpy')]\n"
        "assert not bad, bad\n"
        "assert sorted(allocator.__all__) == allocator.__all__\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

"""Stateful fuzzing of ``allocator.Pool`` against reference models (CPU only).

The models: the set of live ``(ptr, size)`` ranges; best fit computed from the snapshot's block
list; and, for cross-stream safety, the last stream that used each freed range and how much work
it had enqueued then (memory may only reach another stream once that work has finished).
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from pool_helpers import FakeEvents, assert_disjoint, expected_best_fit, segment_blocks

from allocator import (
    IntRangeSource,
    InvalidFree,
    Pool,
    PoolExhausted,
    SnapshotStale,
    check_invariants,
    round_up,
)

MiB = 1 << 20
LIMIT = 12 * MiB
SIZES = st.one_of(
    st.integers(1, 8 << 10),
    st.integers(1, 1 << 20),
    st.integers((1 << 20) + 1, 5 << 20),
)
STREAMS = st.integers(0, 2)


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.source = IntRangeSource()
        self.events = FakeEvents()
        self.pool = Pool(self.source, events=self.events, limit=LIMIT, name="fuzz")
        self.live: dict[int, tuple[int, int]] = {}  # model: ptr -> (size, stream)
        self.handles: dict[int, object] = {}  # ptr -> the Block malloc returned (may be stale)
        self.freed: list[int] = []  # pointers freed at some point, for double frees
        # (lo, hi, stream, work enqueued on stream when freed) of memory not live since
        self.last_use: list[tuple[int, int, int, int]] = []
        self.snaps: list[tuple] = []  # (snapshot, live model, last_use model)

    # ------------------------------------------------------------ helpers

    def _malloc(self, nbytes: int, stream: int):
        before = self.pool.snapshot()
        size = round_up(nbytes, 512)
        best = expected_best_fit(before, stream, size)
        try:
            block = self.pool.malloc(nbytes, stream=stream)
        except PoolExhausted as err:
            assert (err.requested, err.limit) == (nbytes, LIMIT)
            assert self.pool.snapshot() == before
            return None
        assert (block.size, block.requested, block.stream) == (size, nbytes, stream)
        assert block.ptr % 512 == 0
        if best is not None:
            assert block.ptr == best
        for ptr, (sz, _) in self.live.items():
            assert block.ptr + size <= ptr or ptr + sz <= block.ptr, "overlaps a live block"
        base = max(b for b in self.source.live_segments if b <= block.ptr)
        assert block.ptr + size <= base + self.source.live_segments[base], "outside its segment"
        self._check_cross_stream(block.ptr, block.ptr + size, stream)
        self.live[block.ptr] = (size, stream)
        self.handles[block.ptr] = block
        return block.ptr

    def _check_cross_stream(self, lo: int, hi: int, stream: int) -> None:
        kept = []
        for rlo, rhi, rstream, work in self.last_use:
            if rhi <= lo or hi <= rlo:
                kept.append((rlo, rhi, rstream, work))
                continue
            assert rstream == stream or self.events.finished[rstream] >= work, (
                f"0x{max(lo, rlo):x} reused on stream {stream} before stream {rstream} finished")
            if rlo < lo:
                kept.append((rlo, lo, rstream, work))
            if hi < rhi:
                kept.append((hi, rhi, rstream, work))
        self.last_use = kept

    def _restorable(self, snap) -> bool:
        held = self.source.live_segments
        return all(held.get(seg.base) == seg.nbytes for seg in snap.segments)

    # ------------------------------------------------------------ rules

    @rule(nbytes=SIZES, stream=STREAMS)
    def malloc(self, nbytes, stream):
        if self._malloc(nbytes, stream) is not None:
            self.events.launch(stream)  # the new block's user enqueues work

    @precondition(lambda self: self.live)
    @rule(data=st.data(), on=st.one_of(st.none(), STREAMS), by_handle=st.booleans())
    def free(self, data, on, by_handle):
        ptr = data.draw(st.sampled_from(sorted(self.live)))
        size, stream = self.live.pop(ptr)
        last = stream if on is None else on
        self.events.launch(last)  # the last use, on the stream the block is freed on
        self.last_use.append((ptr, ptr + size, last, self.events.launched[last]))
        # A handle from malloc, possibly from before a restore: free looks it up by address.
        self.pool.free(self.handles[ptr] if by_handle else ptr, stream=on)
        self.freed.append(ptr)

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def double_free(self, data):
        ptr = data.draw(st.sampled_from(self.freed))
        if ptr in self.live:
            return
        before = self.pool.snapshot()
        try:
            self.pool.free(ptr)
        except InvalidFree as err:
            assert f"0x{ptr:x}" in str(err)
        else:
            raise AssertionError(f"free of dead ptr 0x{ptr:x} did not raise")
        assert self.pool.snapshot() == before

    @rule(stream=STREAMS)
    def finish(self, stream):
        self.events.finish(stream)

    @rule()
    def snapshot(self):
        self.snaps.append((self.pool.snapshot(), dict(self.live), list(self.last_use)))

    @precondition(lambda self: self.snaps)
    @rule(data=st.data())
    def restore(self, data):
        snap, live, last_use = data.draw(st.sampled_from(self.snaps))
        before = self.pool.snapshot()
        if not self._restorable(snap):
            try:
                self.pool.restore(snap)
            except SnapshotStale:
                assert self.pool.snapshot() == before
                return
            raise AssertionError("restore needing a released segment did not raise")
        old = {(p, s) for p, (s, _) in self.live.items()}
        new = {(p, s) for p, (s, _) in live.items()}
        delta = self.pool.restore(snap)
        assert delta.became_free == tuple(sorted(old - new))
        assert delta.became_live == tuple(sorted(new - old))
        assert self.pool.snapshot() == snap
        self.live, self.last_use = dict(live), list(last_use)

    @rule(ops=st.lists(st.tuples(SIZES, STREAMS), min_size=1, max_size=4))
    def replay_after_restore(self, ops):
        """The same calls from the same snapshot give the same pointers (spares included)."""
        snap, live, last_use = self.pool.snapshot(), dict(self.live), list(self.last_use)
        releases = self.source.num_releases
        first = [self._malloc(n, s) for n, s in ops]
        if self.source.num_releases != releases:
            return  # the limit path released segments or spares: replay may differ, keep state
        self.pool.restore(snap)
        self.live, self.last_use = dict(live), list(last_use)
        second = [self._malloc(n, s) for n, s in ops]
        assert second == first

    @rule()
    def trim(self):
        held = self.source.reserved_bytes
        released = self.pool.trim()
        assert self.source.reserved_bytes == held - released
        assert self.pool.stats().spare_segments == 0
        for recs in segment_blocks(self.pool.snapshot()).values():
            assert not (len(recs) == 1 and recs[0].is_free), "trim left an empty segment"

    @rule()
    def free_all(self):
        for ptr in sorted(self.live):
            size, stream = self.live.pop(ptr)
            self.last_use.append((ptr, ptr + size, stream, self.events.launched[stream]))
            self.pool.free(ptr)
            self.freed.append(ptr)
        snap = self.pool.snapshot()
        assert snap.allocated_bytes == 0
        for recs in segment_blocks(snap).values():
            if len({r.stream for r in recs}) == 1:
                assert len(recs) == 1, "a segment free on one stream is not one block"

    # ------------------------------------------------------------ invariants

    @invariant()
    def consistent(self):
        check_invariants(self.pool)
        snap = self.pool.snapshot()
        assert snap.live == tuple(sorted((p, s) for p, (s, _) in self.live.items()))
        assert_disjoint(list(snap.live))
        st_ = self.pool.stats()
        assert st_.allocated_bytes == sum(s for s, _ in self.live.values())
        assert st_.live_blocks == len(self.live)
        assert st_.reserved_bytes == sum(seg.nbytes for seg in snap.segments)
        assert self.source.reserved_bytes == st_.reserved_bytes + st_.spare_bytes
        assert len(self.source.live_segments) == st_.segments + st_.spare_segments
        assert st_.reserved_bytes + st_.spare_bytes <= LIMIT

    def teardown(self):
        self.pool.close()
        assert self.source.reserved_bytes == 0


PoolMachine.TestCase.settings = settings(
    max_examples=1000,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPoolMachine = PoolMachine.TestCase


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(SIZES, st.booleans()), min_size=1, max_size=40))
def test_single_stream_free_everything_coalesces_to_whole_segments(ops):
    source = IntRangeSource()
    pool = Pool(source)
    live = []
    for nbytes, do_free in ops:
        if do_free and live:
            pool.free(live.pop(len(live) // 2))
        else:
            live.append(pool.malloc(nbytes))
    for block in live:
        pool.free(block)
    check_invariants(pool)
    st_ = pool.stats()
    assert st_.free_blocks == st_.segments and st_.allocated_bytes == 0
    assert pool.trim() == st_.reserved_bytes
    assert source.reserved_bytes == 0

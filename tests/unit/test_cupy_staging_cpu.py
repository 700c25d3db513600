"""CPU tests of issue 17's pinned staging (``cgraw.interop.cupy_staging``): the arena's bookkeeping
over fake host addresses, per-graph ownership, release on close and on collection, the quarantine
until the devices are synchronised, the exhaustion error, and the environment setting."""

from __future__ import annotations

import gc

import pytest

from cgraw import _defer
from cgraw.errors import CaptureError
from cgraw.interop import cupy_staging as st


class FakeHost:
    """``cuMemHostAlloc``/``cuMemFreeHost`` over increasing fake addresses."""

    def __init__(self):
        self.next = 0x7000_0000
        self.live: dict[int, int] = {}
        self.allocs = 0

    def alloc(self, n: int) -> int:
        p, self.next = self.next, self.next + n + 4096
        self.live[p] = n
        self.allocs += 1
        return p

    def free(self, p: int) -> None:
        del self.live[p]


def make_arena(capacity=8192):
    host = FakeHost()
    return st.PinnedArena(capacity, st.HostSource(host.alloc, host.free)), host


class FakeGraph:
    """What the capture hands a staged holder to: a keep-alive list that close() clears."""

    def __init__(self):
        self._keepalive = []

    def close(self):
        self._keepalive = []


def capture_into(arena, sizes, device=0):
    staging = st.CaptureStaging(arena, device)
    for n in sizes:
        staging.allocate(n, "cupy._creation.from_data.asarray")
    g = FakeGraph()
    holder = staging.finish(failed=False)
    g._keepalive.append(holder)
    return g, holder


def test_the_arena_is_one_segment_reserved_only_outside_captures():
    arena, host = make_arena()
    assert not arena.ready
    _defer.capture_begins()
    try:
        arena.grow()  # a capture routes allocations: the source refuses, nothing is reserved
    except Exception:
        pass
    finally:
        _defer.capture_ends()
    assert not arena.ready and host.allocs == 0
    arena.grow()
    arena.grow()
    assert arena.ready and host.allocs == 1 and list(host.live.values()) == [8192]


def test_blocks_of_live_graphs_never_overlap_and_stay_until_the_graph_goes():
    arena, _ = make_arena()
    arena.grow()
    g1, h1 = capture_into(arena, [100, 1000])
    g2, h2 = capture_into(arena, [700])
    spans = sorted((p, p + n) for p, n in zip(h1.ptrs + h2.ptrs, [512, 1024, 1024]))
    assert all(a_end <= b for (_, a_end), (b, _) in zip(spans, spans[1:]))
    assert arena.stats().allocated_bytes == 512 + 1024 + 1024
    assert h1.calls == ["cupy._creation.from_data.asarray"] * 2


@pytest.mark.parametrize("how", ["close", "collect"])
def test_a_dead_graphs_blocks_are_reused_only_after_the_devices_are_synchronised(how):
    arena, _ = make_arena(1024)
    arena.grow()
    g, holder = capture_into(arena, [1024], device=3)
    old = list(holder.ptrs)
    del holder
    with pytest.raises(CaptureError):  # full while the graph lives
        st.CaptureStaging(arena, 0).allocate(1, "x")
    if how == "close":
        g.close()
    else:
        del g
        gc.collect()
    assert arena.quarantined() == 1
    with pytest.raises(CaptureError):  # quarantined: a replay may still be reading it
        st.CaptureStaging(arena, 0).allocate(1, "x")
    synced = []
    assert arena.drain(synced.append) == 1
    assert synced == [[3]] and arena.quarantined() == 0
    again = st.CaptureStaging(arena, 0)
    assert again.allocate(1024, "x") == old[0]


def test_a_failed_sync_keeps_the_blocks_quarantined():
    arena, _ = make_arena(1024)
    arena.grow()
    g, holder = capture_into(arena, [10])
    del holder
    g.close()

    def boom(devices):
        raise RuntimeError("sync failed")

    with pytest.raises(RuntimeError):
        arena.drain(boom)
    assert arena.quarantined() == 1


def test_a_failed_capture_gives_its_blocks_back_at_once():
    arena, _ = make_arena(1024)
    arena.grow()
    staging = st.CaptureStaging(arena, 0)
    staging.allocate(1024, "x")
    assert staging.finish(failed=True) is None
    assert arena.stats().allocated_bytes == 0 and arena.quarantined() == 0


def test_exhaustion_names_the_call_the_size_and_the_fix():
    arena, _ = make_arena(1024)
    arena.grow()
    staging = st.CaptureStaging(arena, 0)
    staging.allocate(600, "cupyx.scipy.ndimage._filters.gaussian_filter")
    with pytest.raises(CaptureError) as ei:
        staging.allocate(600, "cupyx.scipy.ndimage._filters.gaussian_filter")
    e = ei.value
    assert e.name == "UPLOAD_NOT_COVERED"
    assert "cupyx.scipy.ndimage._filters.gaussian_filter" in str(e) and "600 bytes" in str(e)
    assert "CGRAW_PINNED_STAGING_BYTES" in e.hint
    # the capture's classifier passes the message on unchanged
    from cgraw.interop.cupy import CupyRouting

    assert CupyRouting.classify(e).startswith(e.description)


def test_staging_off_or_unavailable_fails_clearly():
    staging = st.CaptureStaging(None, 0, "CGRAW_PINNED_STAGING_BYTES is 0 (staging is off)")
    with pytest.raises(CaptureError, match="staging is off"):
        staging.allocate(8, "cupy._creation.from_data.asarray")
    assert staging.finish(failed=False) is None


@pytest.mark.parametrize("raw,want", [("", st.DEFAULT_BYTES), ("0", 0), ("1000", 1024), ("4k", 4096),
                                      ("1.5m", 1536 << 10), ("2G", 2 << 30)])
def test_the_environment_setting(monkeypatch, raw, want):
    monkeypatch.setenv("CGRAW_PINNED_STAGING_BYTES", raw)
    assert st.staging_bytes() == want


def test_a_bad_environment_setting_is_named(monkeypatch):
    monkeypatch.setenv("CGRAW_PINNED_STAGING_BYTES", "lots")
    with pytest.raises(ValueError, match="CGRAW_PINNED_STAGING_BYTES"):
        st.staging_bytes()


def test_the_calling_cupy_function_is_found_on_the_stack():
    from cgraw.interop.cupy import outermost_cupy_frame

    def frame_in(module):
        ns = {"__name__": module}
        exec("import sys\ndef asarray():\n    return sys._getframe()\n", ns)
        return ns["asarray"]()

    frames = [frame_in("user"), frame_in("cupyx.scipy.ndimage._filters"), frame_in("cupy._creation.from_data")]
    assert outermost_cupy_frame(frames) == "cupyx.scipy.ndimage._filters.asarray"
    assert outermost_cupy_frame(frames[:1]) is None


# ---------------------------------------------------------------- installing into a fake CuPy


def fake_cupy(monkeypatch):
    """Enough of CuPy's pinned-memory module for install/uninstall: a pool, _malloc, Event."""
    import sys
    import types

    pm = types.ModuleType("cupy.cuda.pinned_memory")

    class PinnedMemory:
        def __init__(self, size):
            self.ptr, self.size = (0x1000 if size else 0), size

    class PooledPinnedMemory(PinnedMemory):
        def __init__(self, size, pool):
            super().__init__(size)
            self.pool = pool

    class PinnedMemoryPointer:
        def __init__(self, mem, offset):
            self.mem, self.ptr = mem, mem.ptr + offset

    class Pool:
        def __init__(self):
            import weakref

            self._ref = weakref.ref(self)

        def malloc(self, size):
            return PinnedMemoryPointer(PooledPinnedMemory(size, self._ref) if size else PinnedMemory(0), 0)

    def _malloc(size):
        return PinnedMemoryPointer(PinnedMemory(size), 0)

    class Event:
        queried = 0

        @property
        def done(self):
            Event.queried += 1
            return False

    pm.PinnedMemory, pm.PooledPinnedMemory, pm._malloc = PinnedMemory, PooledPinnedMemory, _malloc
    pool = Pool()
    state = {"current": pool.malloc}

    def set_pinned_memory_allocator(fn=None):
        state["current"] = _malloc if fn is None else fn

    cuda = types.SimpleNamespace(PinnedMemoryPointer=PinnedMemoryPointer, Event=Event,
                                 set_pinned_memory_allocator=set_pinned_memory_allocator,
                                 alloc_pinned_memory=lambda n: state["current"](n))
    cupy = types.SimpleNamespace(cuda=cuda)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda.pinned_memory", pm)
    monkeypatch.setattr(st, "_done_patched", False)
    return cupy, state, pool, _malloc


@pytest.mark.parametrize("start", ["pool", "none"])
def test_install_and_uninstall_put_the_previous_allocator_back(monkeypatch, start):
    cupy, state, pool, _malloc = fake_cupy(monkeypatch)
    if start == "none":
        cupy.cuda.set_pinned_memory_allocator(None)
    assert st.install(cupy) == "" and st.install(cupy) == ""  # two captures
    assert state["current"] is st._dispatcher
    # a thread outside any capture gets the previous allocator's memory
    got = cupy.cuda.alloc_pinned_memory(100)
    assert type(got.mem).__name__ == ("PooledPinnedMemory" if start == "pool" else "PinnedMemory")
    st.uninstall(cupy)
    assert state["current"] is st._dispatcher  # one capture still runs
    st.uninstall(cupy)
    want = pool.malloc if start == "pool" else _malloc
    assert state["current"] == want


def test_an_allocator_set_during_the_capture_stays(monkeypatch):
    cupy, state, pool, _malloc = fake_cupy(monkeypatch)
    assert st.install(cupy) == ""

    def mine(n):
        return _malloc(n)

    cupy.cuda.set_pinned_memory_allocator(mine)
    st.uninstall(cupy)
    assert state["current"] is mine


def test_a_custom_allocator_is_not_replaced(monkeypatch):
    cupy, state, pool, _malloc = fake_cupy(monkeypatch)

    class Custom:
        ptr, size = 0x2000, 512

    def custom(n):
        return cupy.cuda.PinnedMemoryPointer(Custom(), 0)

    cupy.cuda.set_pinned_memory_allocator(custom)
    assert "custom pinned-memory allocator" in st.install(cupy)
    assert state["current"] is custom


def test_event_done_answers_for_staged_events_and_queries_the_rest(monkeypatch):
    cupy, *_ = fake_cupy(monkeypatch)
    st._patch_event_done(cupy)
    ev = cupy.cuda.Event()
    assert ev.done is False and cupy.cuda.Event.queried == 1
    ev._cgraw_staged = True
    assert ev.done is True and cupy.cuda.Event.queried == 1  # never queried: recorded inside a capture

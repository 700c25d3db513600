"""CPU tests of pinned staging (``cgraw.interop.cupy.staging``): the arena's bookkeeping
over fake host addresses, per-graph ownership, release on close and on collection, the quarantine
until the devices are synchronised, the exhaustion error, and the environment setting. The
wrapped ``cupy._core.array`` is tested in ``test_cupy_uploads_cpu.py``."""

from __future__ import annotations

import gc

import pytest

from cgraw._cuda import defer
from cgraw.errors import CaptureError
from cgraw.interop.cupy import staging as st


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
    defer.capture_begins()
    try:
        arena.grow()  # a capture routes allocations: the source refuses, nothing is reserved
    except Exception:
        pass
    finally:
        defer.capture_ends()
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
    from cgraw.interop.cupy.pools import CupyRouting

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
    from cgraw.interop.cupy.pools import outermost_cupy_frame

    def frame_in(module):
        ns = {"__name__": module}
        exec("import sys\ndef asarray():\n    return sys._getframe()\n", ns)
        return ns["asarray"]()

    frames = [frame_in("user"), frame_in("cupyx.scipy.ndimage._filters"), frame_in("cupy._creation.from_data")]
    assert outermost_cupy_frame(frames) == "cupyx.scipy.ndimage._filters.asarray"
    assert outermost_cupy_frame(frames[:1]) is None

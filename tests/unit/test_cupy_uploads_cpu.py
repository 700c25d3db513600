"""CPU tests of upload staging through a wrapped ``cupy._core.array``
(``cgraw.interop.cupy.staging``), with a fake CuPy over real host memory: install and restore,
the thread and capture rules, what goes to CuPy unchanged, the order, dtype, ndmin and byte order
of the staged bytes and their copy on the capture stream, a live graph's block kept, and the
refusals that name the call."""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
import types

import numpy as np
import pytest

from cgraw.runtime import memory
from cgraw.errors import CaptureError
from cgraw.interop.cupy import staging as st


class FakeGraph:
    """What the capture hands a staged holder to: a keep-alive list that close() clears."""

    def __init__(self):
        self._keepalive = []

    def close(self):
        self._keepalive = []


STREAM = types.SimpleNamespace(ptr=0x55, handle="capture-stream-handle")


class RealHost:
    """``cuMemHostAlloc`` over real host buffers: the staged bytes can be read back."""

    def __init__(self):
        self.bufs: dict[int, ctypes.Array] = {}

    def alloc(self, n: int) -> int:
        b = ctypes.create_string_buffer(n)
        self.bufs[ctypes.addressof(b)] = b
        return ctypes.addressof(b)

    def free(self, p: int) -> None:
        del self.bufs[p]


class DeviceArray:
    """What the fake ``cupy.empty`` returns (also the fake ``cupy.ndarray``)."""

    next_ptr = 0xD000_0000

    def __init__(self, shape, dtype, order):
        self.shape, self.dtype, self.order = tuple(shape), np.dtype(dtype), order
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize
        self.data = types.SimpleNamespace(ptr=DeviceArray.next_ptr)
        DeviceArray.next_ptr += 1 << 20


class FakeCupy:
    """``cupy._core.array`` (the original records its calls), ``cupy.empty``, the current stream,
    and cgraw's ``memcpy_htod_async`` recording each copy with the source bytes it would read."""

    def __init__(self, monkeypatch):
        self.calls, self.copies, self.empties = [], [], []
        self.current = types.SimpleNamespace(ptr=STREAM.ptr)

        def original(*args, **kwargs):
            self.calls.append((args, kwargs))
            return "original"

        def empty(shape, dtype=float, order="C"):
            self.empties.append(DeviceArray(shape, dtype, order))
            return self.empties[-1]

        def memcpy(dst, src, n, stream):
            self.copies.append((dst, src, n, stream, ctypes.string_at(src, n)))

        self.original = original
        self.module = types.SimpleNamespace(ndarray=DeviceArray, empty=empty,
                                            _core=types.SimpleNamespace(array=original),
                                            cuda=types.SimpleNamespace(get_current_stream=lambda: self.current))
        monkeypatch.setitem(sys.modules, "cupy", self.module)
        monkeypatch.setattr(st._cuda, "memcpy_htod_async", memcpy)
        monkeypatch.setattr(st, "_installs", 0)
        monkeypatch.setattr(st, "_wrapper", None)

    def array(self, *args, **kwargs):
        return self.module._core.array(*args, **kwargs)


@pytest.fixture
def fake(monkeypatch):
    f = FakeCupy(monkeypatch)
    assert st.install(f.module) == ""
    yield f
    st.uninstall(f.module)
    assert f.module._core.array is f.original


def real_arena(capacity=1 << 16):
    host = RealHost()
    a = st.PinnedArena(capacity, st.HostSource(host.alloc, host.free))
    a.grow()
    return a


@contextlib.contextmanager
def capturing(staging):
    """This thread inside a capture that routes CuPy: its staging entered, the capture proper begun."""
    st.enter(staging)
    memory.capture_guard_enter()
    try:
        yield staging
    finally:
        memory.capture_guard_exit()
        st.leave()


def test_install_wraps_core_array_and_the_last_uninstall_restores_it(monkeypatch):
    f = FakeCupy(monkeypatch)
    assert st.install(f.module) == "" and st.install(f.module) == ""  # two captures
    wrapped = f.module._core.array
    assert wrapped is not f.original and wrapped._cgraw_original is f.original
    st.uninstall(f.module)
    assert f.module._core.array is wrapped  # one capture still runs
    st.uninstall(f.module)
    assert f.module._core.array is f.original
    assert st.install(f.module) == "" and f.module._core.array is not f.original  # the next capture wraps again
    st.uninstall(f.module)
    assert f.module._core.array is f.original


def test_a_function_set_during_the_capture_stays(monkeypatch):
    f = FakeCupy(monkeypatch)
    assert st.install(f.module) == ""

    def mine(*args, **kwargs):
        return "mine"

    f.module._core.array = mine
    st.uninstall(f.module)
    assert f.module._core.array is mine
    assert st.install(f.module) == "" and f.module._core.array._cgraw_original is mine
    st.uninstall(f.module)
    assert f.module._core.array is mine


def test_a_cupy_without_core_array_is_not_wrapped(monkeypatch):
    f = FakeCupy(monkeypatch)
    del f.module._core.array
    assert "cupy._core.array" in st.install(f.module)
    assert st._installs == 0 and not hasattr(f.module._core, "array")


def test_off_the_capture_the_original_gets_the_call_unchanged(fake):
    a = np.arange(4, dtype=np.float32)
    staging = st.CaptureStaging(real_arena(), 0, stream=STREAM)
    assert fake.array(a, None, True, "K", False, 0, False) == "original"  # no staging on this thread
    st.enter(staging)  # staging entered, the capture proper not begun (or already ended)
    try:
        assert fake.array(a, dtype=np.float64, blocking=True) == "original"
    finally:
        st.leave()
    memory.capture_guard_enter()  # another adapter's capture, not routing CuPy's uploads
    try:
        assert fake.array(a) == "original"
    finally:
        memory.capture_guard_exit()
    assert fake.calls == [((a, None, True, "K", False, 0, False), {}), ((a,), {"dtype": np.float64, "blocking": True}),
                          ((a,), {})]
    assert not fake.copies and not staging.ptrs


@pytest.mark.parametrize("other", ["eager", "capturing"])
def test_another_thread_gets_the_original_while_this_one_captures(fake, other):
    a = np.arange(8, dtype=np.float32)
    box = {}

    def worker():  # eager, or inside a capture of its own that does not route CuPy's uploads
        if other == "capturing":
            memory.capture_guard_enter()
        try:
            box["got"] = fake.array(a)
        finally:
            if other == "capturing":
                memory.capture_guard_exit()

    with capturing(st.CaptureStaging(real_arena(), 0, stream=STREAM)) as staging:
        t = threading.Thread(target=worker)
        t.start()
        t.join(10)
        here = fake.array(a)
    assert box["got"] == "original" and len(fake.calls) == 1
    assert isinstance(here, DeviceArray) and len(fake.copies) == 1 and len(staging.ptrs) == 1


class CudaInterface(np.ndarray):
    __cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (0xD00D, False), "version": 3}


class CudaDLPack(np.ndarray):
    def __dlpack_device__(self):
        return (2, 0)


@pytest.mark.parametrize("args,kwargs", [
    ((DeviceArray((3,), np.float32, "C"),), {}),
    ((np.ones(2, np.float32).view(CudaInterface),), {}),
    ((np.ones(2, np.float32).view(CudaDLPack),), {}),
    (([np.ones(2), DeviceArray((2,), np.float64, "C")],), {}),
    ((["a", "b"],), {}),
    ((np.array([1, "x"], dtype=object),), {}),
    ((np.array(["2024-01-01"], dtype="datetime64[D]"),), {}),
    (([[1, 2], [3]],), {}),
    ((np.ones(3, np.float32),), {"subok": True}),
    ((np.ones(3, np.float32),), {"order": "X"}),
], ids=["cupy-array", "cuda-array-interface", "cuda-dlpack", "list-with-device-array", "strings", "object",
        "datetime", "ragged", "subok", "bad-order"])
def test_device_and_unconvertible_objects_go_to_cupy(fake, args, kwargs):
    with capturing(st.CaptureStaging(real_arena(), 0, stream=STREAM)) as staging:
        assert fake.array(*args, **kwargs) == "original"
    assert fake.calls == [(args, kwargs)]
    assert not fake.copies and not fake.empties and not staging.ptrs


def test_an_upload_on_another_stream_goes_to_cupy(fake):
    fake.current = types.SimpleNamespace(ptr=0x77)  # a side stream made current inside the capture
    with capturing(st.CaptureStaging(real_arena(), 0, stream=STREAM)) as staging:
        assert fake.array(np.ones(3)) == "original"
    assert not fake.copies and not staging.ptrs


F34 = np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4))
C34 = np.arange(12, dtype=np.float32).reshape(3, 4)


@pytest.mark.parametrize("args,kwargs,shape,dtype,order,data", [
    ((C34,), {}, (3, 4), np.float32, "C", C34.tobytes()),
    ((F34,), {}, (3, 4), np.float64, "F", F34.tobytes(order="F")),
    ((F34, None, True, "K", False, 0, False), {}, (3, 4), np.float64, "F", F34.tobytes(order="F")),
    ((F34,), {"order": "A"}, (3, 4), np.float64, "F", F34.tobytes(order="F")),
    ((F34,), {"order": "C"}, (3, 4), np.float64, "C", F34.tobytes(order="C")),
    ((C34,), {"order": "F"}, (3, 4), np.float32, "F", C34.tobytes(order="F")),
    ((C34[:, ::2],), {}, (3, 2), np.float32, "C", C34[:, ::2].tobytes()),
    (([[1, 2], [3, 4]],), {"dtype": np.float32}, (2, 2), np.float32, "C", np.float32([1, 2, 3, 4]).tobytes()),
    ((np.arange(5, dtype=">i4"),), {}, (5,), np.int32, "C", np.arange(5, dtype="<i4").tobytes()),
    ((np.arange(4.0),), {"ndmin": 3}, (1, 1, 4), np.float64, "C", np.arange(4.0).tobytes()),
    ((2.5,), {}, (), np.float64, "C", np.float64(2.5).tobytes()),
    ((np.int16(7),), {"dtype": np.float32}, (), np.float32, "C", np.float32(7).tobytes()),
    (((np.arange(3), np.arange(3) + 3),), {}, (2, 3), np.int64, "C", np.arange(6, dtype=np.int64).tobytes()),
    (([True, False, True],), {}, (3,), np.bool_, "C", b"\x01\x00\x01"),
], ids=["c", "f-k", "f-positional", "f-a", "f-to-c", "c-to-f", "strided", "list-dtype", "big-endian", "ndmin",
        "py-scalar", "np-scalar-dtype", "tuple-of-arrays", "bools"])
def test_host_data_is_staged_and_copied_on_the_capture_stream(fake, args, kwargs, shape, dtype, order, data):
    arena = real_arena()
    with capturing(st.CaptureStaging(arena, 0, stream=STREAM)) as staging:
        out = fake.array(*args, **kwargs)
    assert not fake.calls  # CuPy's own upload (refused in a capture) never ran
    assert isinstance(out, DeviceArray) and out.shape == shape and out.dtype == np.dtype(dtype)
    assert out.order == order and out.dtype.isnative
    [(dst, src, n, stream, got)] = fake.copies
    assert (dst, n, stream) == (out.data.ptr, len(data), STREAM.handle) and got == data
    assert staging.ptrs == [src] and arena.stats().allocated_bytes >= n
    assert staging.calls == ["cupy._core.array"]  # no CuPy frame on this stack


def test_a_zero_byte_upload_takes_no_block_and_makes_no_copy(fake):
    with capturing(st.CaptureStaging(real_arena(), 0, stream=STREAM)) as staging:
        out = fake.array(np.zeros((0, 3), np.float32))
    assert out.shape == (0, 3) and not fake.copies and not staging.ptrs


def test_blocking_true_is_staged_without_waiting(fake):
    def synchronize():
        raise AssertionError("waited on the capture stream")

    fake.current = types.SimpleNamespace(ptr=STREAM.ptr, synchronize=synchronize)
    with capturing(st.CaptureStaging(real_arena(), 0, stream=STREAM)):
        out = fake.array(np.ones(4, np.float32), blocking=True)
    assert isinstance(out, DeviceArray) and len(fake.copies) == 1


def called_from(module: str, fn):
    """``fn()`` run from a function named ``asarray`` in ``module`` (as CuPy's frames are named)."""
    ns = {"__name__": module, "fn": fn}
    exec("def asarray():\n    return fn()\n", ns)
    return ns["asarray"]()


@pytest.mark.parametrize("arena", ["small", "off"])
def test_an_upload_that_cannot_be_staged_is_refused_naming_the_call(fake, arena):
    staging = (st.CaptureStaging(real_arena(1024), 0, stream=STREAM) if arena == "small" else
               st.CaptureStaging(None, 0, "CGRAW_PINNED_STAGING_BYTES is 0 (staging is off)", STREAM))
    with capturing(staging), pytest.raises(CaptureError) as ei:
        called_from("cupy._creation.from_data", lambda: fake.array(np.ones(500, np.float32)))
    e = ei.value
    assert e.name == "UPLOAD_NOT_COVERED" and "2000 bytes" in str(e)
    assert "[cupy._creation.from_data.asarray]" in str(e) and "make the device array before the capture" in e.hint
    assert ("CGRAW_PINNED_STAGING_BYTES" in e.hint) and ("staging is off" in str(e)) == (arena == "off")
    assert not fake.copies and not fake.empties and not fake.calls


def test_a_live_graphs_block_keeps_the_recorded_bytes_until_it_is_closed_and_synced(fake):
    arena = real_arena(2048)
    a, b, c = (np.full(256, v, np.float32) for v in (1, 2, 3))  # 1024 bytes each: the arena holds two

    def capture(host):
        with capturing(st.CaptureStaging(arena, 0, stream=STREAM)) as staging:
            fake.array(host)
        g = FakeGraph()
        g._keepalive.append(staging.finish(failed=False))
        return g, fake.copies[-1][1]

    g1, src1 = capture(a)
    g2, src2 = capture(b)
    assert src1 != src2 and ctypes.string_at(src1, 1024) == a.tobytes()  # g2 never wrote into g1's block
    g1.close()
    with pytest.raises(CaptureError):  # g1's block waits for the device: a replay may still read it
        capture(c)
    assert arena.drain(lambda devices: None) == 1
    g3, src3 = capture(c)
    assert src3 == src1 and ctypes.string_at(src2, 1024) == b.tobytes()


def test_the_routing_wraps_before_the_capture_and_restores_after(fake, monkeypatch):
    from cgraw.interop.cupy.pools import CupyRouting

    arena = real_arena(1024)
    monkeypatch.setattr(st, "_arena", arena)
    outer = fake.module._core.array  # the fixture's install: a capture already running
    pool = types.SimpleNamespace(device=types.SimpleNamespace(ordinal=0))
    r = CupyRouting(pool, STREAM, [])
    r.prepare()
    assert fake.module._core.array is outer and st._installs == 2 and r._staging.stream is STREAM
    st.enter(r._staging)
    memory.capture_guard_enter()
    try:
        fake.array(np.ones(8, np.float32))
    finally:
        memory.capture_guard_exit()
    r.unprepare(failed=True)
    assert st._installs == 1 and getattr(st._tls, "staging", None) is None
    assert arena.stats().allocated_bytes == 0 and not r.keepalive  # a failed capture's block is free at once


def test_cupys_refusal_of_a_captured_copy_is_named_as_an_upload():
    from cgraw.interop.cupy.pools import UPLOAD, CupyRouting

    assert CupyRouting.classify(RuntimeError("the current stream is capturing, so H2D transfers are disallowed")) \
        == UPLOAD

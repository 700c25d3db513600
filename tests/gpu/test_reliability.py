"""GPU tier, reliability: fault injection, threads, bad input, and (slow) a soak.

Every case ends with a correct result or a clear error, never a wrong number; after each fault
no stream is left capturing, the pool equals its snapshot, and the next capture works.
"""

from __future__ import annotations

import gc
import threading

import pytest
from gpu_data import crand, trand

import cgraw
from cgraw import _cuda

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_trees")]
torch = pytest.importorskip("torch")
cp = pytest.importorskip("cupy")


def _capture_works(pool):
    x = trand(300)
    with cgraw.capture(pool=pool) as g:
        y = torch.exp(x) - 1.0
        c = cp.from_dlpack(y) * 2.0
    x.copy_(trand(300))
    g.replay()
    torch.testing.assert_close(y, torch.exp(x) - 1.0)
    assert cp.array_equal(c, cp.from_dlpack(torch.exp(x) - 1.0) * 2.0)
    g.close()


def _clean(pool, snap):
    assert pool.capture_stream.capture_status == 0
    assert pool.snapshot() == snap
    _capture_works(pool)


# ---------------------------------------------------------------- fault injection


def test_out_of_memory_inside_capture(device):
    pool = cgraw.DevicePool(device, limit=16 << 20, name="small")
    x = crand(1000)
    snap = pool.snapshot()
    with pytest.raises(MemoryError) as ei:
        with cgraw.capture(pool=pool):
            _ = cp.exp(x)
            _ = cp.empty(64 << 20, dtype=cp.uint8)  # over the limit
    assert isinstance(ei.value, cgraw.PoolExhausted) and ei.value.limit == 16 << 20
    _clean(pool, snap)
    pool.close()


def test_forced_instantiate_failure(pool, monkeypatch):
    x = trand(100)
    snap = pool.snapshot()
    before = dict(_cuda.live_handles)

    def fail(*a, **k):
        raise cgraw.CaptureError("cuGraphInstantiateWithParams", 1, "CUDA_ERROR_INVALID_VALUE", "forced")

    monkeypatch.setattr(_cuda, "graph_instantiate", fail)
    with pytest.raises(cgraw.CaptureError, match="forced"):
        with cgraw.capture(pool=pool):
            _ = cp.exp(cp.from_dlpack(x))
    monkeypatch.undo()
    gc.collect()
    assert _cuda.live_handles["graph"] == before.get("graph", 0)
    _clean(pool, snap)


def test_keyboard_interrupt_while_recording_a_graphed_function(pool):
    calls = {"n": 0}

    def body(x):
        calls["n"] += 1
        if calls["n"] == 2:  # the recording call
            raise KeyboardInterrupt
        return torch.tanh(x) * 3.0

    f = cgraw.graphed(body)
    f(trand(64))
    with pytest.raises(KeyboardInterrupt):
        f(trand(64))
    import sys

    tree_pool = sys.modules["cgraw.trees.graphed"]._managers[0].backend.pool
    assert tree_pool.capture_stream.capture_status == 0
    for _ in range(4):
        x = trand(64)
        torch.testing.assert_close(f(x), torch.tanh(x) * 3.0)
    _capture_works(pool)


def test_user_exception_in_graphed_function_propagates(pool):
    def body(x):
        if x.shape[0] == 7:
            raise ValueError("bad shape 7")
        return x + 1.0

    f = cgraw.graphed(body)
    for _ in range(3):
        x = trand(8)
        torch.testing.assert_close(f(x), x + 1.0)
    with pytest.raises(ValueError, match="bad shape 7"):
        f(trand(7))
    x = trand(8)
    torch.testing.assert_close(f(x), x + 1.0)


# ---------------------------------------------------------------- threads


def test_capture_while_another_thread_runs_eager_work(pool):
    stop = threading.Event()
    errors = []

    def eager_worker():
        try:
            s = torch.cuda.Stream()
            cs = cp.cuda.Stream(non_blocking=True)
            while not stop.is_set():
                with torch.cuda.stream(s):
                    a = torch.randn(4096, device="cuda")
                    ok = torch.equal(a * 3.0, a + a + a)
                with cs:
                    b = cp.arange(4096, dtype=cp.float32)
                    okc = bool((b * 2.0 == b + b).all())
                if not (ok and okc):
                    errors.append("wrong eager result")
        except BaseException as e:  # reported below
            errors.append(repr(e))

    t = threading.Thread(target=eager_worker)
    t.start()
    try:
        for _ in range(20):
            x = trand(2048)
            with cgraw.capture(pool=pool) as g:
                y = torch.sin(x) * x
                z = cp.cos(cp.from_dlpack(y))
            for _ in range(3):
                x.copy_(trand(2048))
                g.replay()
                torch.testing.assert_close(y, torch.sin(x) * x)
                assert cp.allclose(z, cp.cos(cp.from_dlpack(torch.sin(x) * x)))
            g.close()
    finally:
        stop.set()
        t.join()
    assert not errors, errors


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("case", ["noncontiguous", "zero_size", "zero_d", "dtype_change", "returns_input",
                                  "returns_view", "freed_between_warmup_and_record", "cupy_noncontiguous"])
def test_bad_inputs_graphed(case):
    if case == "noncontiguous":
        body = lambda x: x * 2.0  # noqa: E731
        inputs = [trand(16, 8).t() for _ in range(5)]
    elif case == "zero_size":
        body = lambda x: x + 1.0  # noqa: E731
        inputs = [trand(0, 4) for _ in range(4)]
    elif case == "zero_d":
        body = lambda x: x * 3.0  # noqa: E731
        inputs = [trand(()) for _ in range(5)]
    elif case == "dtype_change":
        body = lambda x: x * 2  # noqa: E731
        inputs = [trand(10), trand(10).double(), trand(10), trand(10).half(), trand(10), trand(10).double()]
    elif case == "returns_input":
        body = lambda x: x  # noqa: E731
        inputs = [trand(10) for _ in range(5)]
    elif case == "returns_view":
        body = lambda x: x[2:7]  # noqa: E731
        inputs = [trand(10) for _ in range(5)]
    elif case == "freed_between_warmup_and_record":
        body = lambda x: x.exp()  # noqa: E731
        inputs = None
    else:
        body = lambda a: a * 2.0  # noqa: E731
        inputs = [crand(16, 8).T for _ in range(5)]
    f = cgraw.graphed(body)
    if inputs is None:
        x = trand(100)
        f(x)
        del x
        gc.collect()
        torch.cuda.empty_cache()
        for _ in range(4):
            cgraw.mark_step_begin()
            x = trand(100)
            torch.testing.assert_close(f(x), body(x))
        return
    for x in inputs:
        cgraw.mark_step_begin()
        got, ref = f(x), body(x)
        if isinstance(ref, torch.Tensor):
            assert got.dtype == ref.dtype and got.shape == ref.shape
            torch.testing.assert_close(got, ref)
        else:
            assert cp.array_equal(got, ref)


def test_bad_inputs_capture(pool):
    x_cpu = torch.randn(10)
    with pytest.raises(cgraw.CaptureError, match="host-to-device copy from pageable memory"):
        with cgraw.capture(pool=pool):
            _ = x_cpu.cuda() * 2.0
    assert pool.capture_stream.capture_status == 0
    for shape in ((0, 3), (), (4, 5)):
        x = torch.randn(shape, device="cuda")
        xt = x.t() if x.dim() == 2 else x
        with cgraw.capture(pool=pool) as g:
            y = xt * 2.0 + 1.0
        x.copy_(torch.randn(shape, device="cuda"))
        g.replay()
        torch.testing.assert_close(y, xt * 2.0 + 1.0)
        g.close()


# ---------------------------------------------------------------- soak


@pytest.mark.slow
def test_soak_replays_and_rerecords(device):
    import sys

    def body(x, w):
        return torch.sin(x) * w + 1.0

    f = cgraw.graphed(body, static_argnums=(1,))
    x, w1, w2 = trand(4096), trand(4096), trand(4096)
    for _ in range(3):
        f(x, w1)
    torch.cuda.synchronize()
    gc.collect()
    mgr = sys.modules["cgraw.trees.graphed"]._managers[0]
    pool = mgr.backend.pool

    def probe():
        """(driver free bytes, pool reserved bytes with torch's part, Python objects)."""
        return (device.mem_get_info()[0], pool.stats().reserved_bytes + pool.torch_reserved_bytes,
                len(gc.get_objects()))

    free0, pool0, objs0 = probe()
    for _ in range(100_000):
        y = f(x, w1)
    torch.cuda.synchronize()
    torch.testing.assert_close(y, body(x, w1))
    del y
    gc.collect()
    free1, pool1, objs1 = probe()
    rer0 = mgr.stats[f.fn_id].rerecords
    # every call moves the static input: a re-record each time. Each recording first releases
    # torch's cached free memory (config.empty_cache_on_record, as torch.cuda.graph), so the first
    # ones may give back a segment the warm-up left free in the tree's pool; from then on the pool
    # must not move at all
    for i in range(10):
        y = f(x, w2 if i % 2 == 0 else w1)
    del y
    gc.collect()
    pool_settled = probe()[1]
    for i in range(10, 1000):
        y = f(x, w2 if i % 2 == 0 else w1)
    torch.cuda.synchronize()
    torch.testing.assert_close(y, body(x, w1))
    del y
    gc.collect()
    free2, pool2, objs2 = probe()
    rerecords = mgr.stats[f.fn_id].rerecords - rer0
    print(f"\nsoak: 100000 replays: driver free {free0 - free1:+d} B, pool {pool1 - pool0:+d} B, "
          f"objects {objs1 - objs0:+d}; {rerecords} re-records: driver free {free1 - free2:+d} B, "
          f"pool {pool_settled - pool1:+d} B over the first 10, then {pool2 - pool_settled:+d} B, "
          f"objects {objs2 - objs1:+d}")
    assert rerecords == 1000
    assert pool1 == pool0
    assert pool_settled <= pool1 and pool2 == pool_settled
    assert abs(free1 - free0) <= 4 << 20
    assert abs(free2 - free1) <= 64 << 20
    assert abs(objs1 - objs0) < 2000 and abs(objs2 - objs1) < 2000

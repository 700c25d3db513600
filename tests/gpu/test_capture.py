"""GPU tier for cgraw.capture(), Graph and the DLPack Tensor: replay is compared with eager
execution on fresh random inputs every time."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
from gpu_data import crand, rng, trand

import cgraw

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
cp = pytest.importorskip("cupy")

def not_capturing(pool):
    assert pool.capture_stream.capture_status == 0


# ---------------------------------------------------------------- capture and replay


@pytest.mark.parametrize("mode", ["thread_local", "global", "relaxed"])
def test_cupy_only(pool, mode):
    x = crand(4096)
    with cgraw.capture(pool=pool, mode=mode) as g:
        y = cp.sin(x) * 2.0 + x
        z = cp.cumsum(y)
    assert g.num_nodes >= 2
    for _ in range(3):
        x[...] = crand(4096)
        g.replay()
        ey = cp.sin(x) * 2.0 + x
        assert cp.array_equal(y, ey)
        assert cp.array_equal(z, cp.cumsum(ey))
    assert pool.owns(int(y.data.ptr)) and pool.owns(int(z.data.ptr))
    not_capturing(pool)


def test_torch_only(pool):
    x = trand(512)
    w = trand(256, 512)
    with cgraw.capture(pool=pool) as g:
        y = torch.relu(w @ x) + 1.0
        s = y.softmax(0)
    for _ in range(3):
        x.copy_(trand(512))
        w.copy_(trand(256, 512))
        g.replay()
        ey = torch.relu(w @ x) + 1.0
        torch.testing.assert_close(y, ey, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s, ey.softmax(0), rtol=1e-5, atol=1e-6)
    # torch's output lives in the pool's private torch MemPool (torch's own allocator)
    assert pool.torch_state.owner_of()(y.data_ptr())
    assert y.data_ptr() in pool.torch_state.allocated()


def test_private_pool_graph(device):
    x = trand(1000)
    with cgraw.capture() as g:
        y = torch.cos(x) * x
    x.copy_(trand(1000))
    g.replay()
    torch.testing.assert_close(y, torch.cos(x) * x)
    assert g.pool is not None and g.pool.torch_reserved_bytes > 0
    g.close()
    with pytest.raises(cgraw.CgrawError, match="closed"):
        g.replay()


def test_mixed_torch_cupy_torch(pool):
    a = trand(64, 128)
    b = trand(128, 32)
    with cgraw.capture(pool=pool) as g:
        h = a @ b                                  # torch matmul
        hc = cp.from_dlpack(h)                     # zero-copy into CuPy
        gc_ = cp.tanh(hc) * 3.0 + 0.5              # CuPy elementwise
        out = torch.from_dlpack(gc_).sum(dim=1)    # torch reduction
    for _ in range(3):
        a.copy_(trand(64, 128))
        b.copy_(trand(128, 32))
        g.replay()
        eh = a @ b
        eout = (torch.tanh(eh) * 3.0 + 0.5).sum(dim=1)
        torch.testing.assert_close(out, eout, rtol=1e-4, atol=1e-4)
    del hc, gc_


def test_multi_stream_fork_join(pool):
    x = trand(2048)
    side = torch.cuda.Stream()
    with cgraw.capture(pool=pool) as g:
        cur = torch.cuda.current_stream()
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            b2 = torch.exp(x) * 3.0
        y1 = torch.sin(x) + 1.0
        cur.wait_stream(side)
        out = y1 * b2
    for _ in range(3):
        x.copy_(trand(2048))
        g.replay()
        torch.testing.assert_close(out, (torch.sin(x) + 1.0) * (torch.exp(x) * 3.0))
    assert g.num_nodes >= 3


def test_unjoined_side_stream_is_named(pool):
    x = trand(256)
    side = torch.cuda.Stream()
    snap = pool.snapshot()
    with pytest.raises(cgraw.CaptureError, match=f"0x{side.cuda_stream:x}"):
        with cgraw.capture(pool=pool):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                _ = x * 2.0
    assert pool.snapshot() == snap
    not_capturing(pool)
    assert cgraw.Stream.of(side).capture_status == 0
    _capture_works(pool)


# ---------------------------------------------------------------- failures inside the block


def _capture_works(pool):
    x = trand(777)
    with cgraw.capture(pool=pool) as g:
        y = x * 2.0 - 1.0
        c = cp.sqrt(cp.abs(cp.from_dlpack(y)))
    x.copy_(trand(777))
    g.replay()
    torch.testing.assert_close(y, x * 2.0 - 1.0)
    assert cp.array_equal(c, cp.sqrt(cp.abs(cp.from_dlpack(x * 2.0 - 1.0))))
    g.close()


def _fail(pool, body, match):
    snap = pool.snapshot()
    with pytest.raises(cgraw.CaptureError, match=match) as ei:
        with cgraw.capture(pool=pool):
            body()
    assert ei.value.__cause__ is not None  # chained to the original error
    assert pool.snapshot() == snap
    not_capturing(pool)
    _capture_works(pool)


def test_failure_item(pool):
    x = trand(100)
    _fail(pool, lambda: (x * 2).sum().item(), "host synchronisation")


def test_failure_cpu_copy(pool):
    x = trand(100)
    _fail(pool, lambda: (x * 2).cpu(), "host synchronisation")


def test_failure_cupy_get(pool):
    x = crand(100)

    def body():
        y = cp.exp(x)  # a CuPy block allocated inside the failed capture
        y.get()

    _fail(pool, body, "host synchronisation")


def test_failure_torch_rng_uncovered_op_is_named(pool):
    # cgraw draws rand/randn/dropout/... itself (tests/gpu/test_rng.py); randperm it does not cover
    _fail(pool, lambda: torch.randperm(10, device="cuda"), "randperm")


def test_failure_torch_rng_with_random_off(pool):
    snap = pool.snapshot()
    with pytest.raises(cgraw.CaptureError, match="random") as ei:
        with cgraw.capture(pool=pool, random=False):
            torch.rand(10, device="cuda")
    assert ei.value.__cause__ is not None
    assert pool.snapshot() == snap
    not_capturing(pool)
    _capture_works(pool)


def test_failure_cupy_cublas(pool):
    import cupy.cublas

    x = crand(32)
    cupy.cublas.iamax(x)  # warm CuPy's cuBLAS handle
    # CuPy's matrix products are routed to cgraw's handle (tests/gpu/test_cupy_libs.py); isamax is not
    _fail(pool, lambda: cupy.cublas.iamax(x), "cuBLAS")


def test_user_exception_propagates_unchanged(pool):
    x = crand(64)
    snap = pool.snapshot()
    mine = ValueError("my own error")
    with pytest.raises(ValueError) as ei:
        with cgraw.capture(pool=pool):
            _ = cp.exp(x)
            raise mine
    assert ei.value is mine
    assert pool.snapshot() == snap
    not_capturing(pool)
    _capture_works(pool)


def test_keyboard_interrupt_cleans_up(pool):
    x = crand(64)
    snap = pool.snapshot()
    with pytest.raises(KeyboardInterrupt):
        with cgraw.capture(pool=pool):
            _ = cp.exp(x)
            raise KeyboardInterrupt
    assert pool.snapshot() == snap
    not_capturing(pool)
    _capture_works(pool)


def test_cold_torch_matmul_in_new_thread(pool):
    """A cold cuBLAS either captures or fails clearly, and leaves nothing broken."""
    result = {}

    def worker():
        try:
            a = trand(16, 16)
            with cgraw.capture(pool=pool, warm_cublas=False) as g:
                y = a @ a
            g.replay()
            torch.cuda.synchronize()
            result["ok"] = torch.allclose(y, a @ a, atol=1e-4)
        except cgraw.CaptureError as e:
            result["error"] = str(e)
        except BaseException as e:  # anything else is a failure of this test
            result["bad"] = repr(e)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert "bad" not in result, result
    if "error" in result:
        assert "cuBLAS" in result["error"]
    else:
        assert result["ok"]
    not_capturing(pool)
    _capture_works(pool)


def test_warmup_callable_runs_before_capture(pool):
    a = crand(8, 8)
    calls = []

    def warm():
        calls.append(pool.capture_stream.capture_status)

    with cgraw.capture(pool=pool, warmup=warm) as g:
        y = cp.exp(a)
    assert calls == [0]
    a[...] = crand(8, 8)
    g.replay()
    assert cp.array_equal(y, cp.exp(a))


# ---------------------------------------------------------------- Graph API


def test_node_table_and_dot(pool, tmp_path):
    x = trand(4096)
    with cgraw.capture(pool=pool) as g:
        y = torch.sin(x)
        z = y * 2.0
    nodes = g.nodes()
    assert len(nodes) == g.num_nodes >= 2
    kern = [n for n in nodes if n.type == "KERNEL"]
    assert len(kern) >= 2
    for n in kern:
        assert n.kernel and n.kernel != "<unknown kernel>"
        assert all(d >= 1 for d in n.grid) and all(d >= 1 for d in n.block)
        assert n.shared_mem >= 0
    assert any(n.depends_on for n in nodes)
    text = str(g)
    assert "NODE 0: KERNEL" in text and "<<<" in text and "Kernel:" in text
    path = g.to_dot(str(tmp_path / "g.dot"))
    assert "digraph" in open(path).read()
    del z


def test_update_from(pool):
    x1, x2 = trand(1024), trand(1024)
    with cgraw.capture(pool=pool) as g1:
        y1 = x1 * 2.0 + 1.0
    with cgraw.capture(pool=pool) as g2:
        y2 = x2 * 2.0 + 1.0
    x2.copy_(trand(1024))
    g1.update_from(g2)
    g1.replay()
    torch.testing.assert_close(y2, x2 * 2.0 + 1.0)
    with cgraw.capture(pool=pool) as g3:
        _ = torch.sin(x1)
    with pytest.raises(cgraw.CaptureError, match="topology|differ"):
        g1.update_from(g3)
    del y1


def test_replay_on_streams(pool):
    x = trand(333)
    with cgraw.capture(pool=pool) as g:
        y = torch.tanh(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    for stream in (s, cgraw.Stream.of(s), s.cuda_stream):
        x.copy_(trand(333))
        s.wait_stream(torch.cuda.current_stream())
        g.replay(stream)
        torch.cuda.current_stream().wait_stream(s)
        torch.testing.assert_close(y, torch.tanh(x))


def test_nested_capture_rejected(pool):
    with pytest.raises(cgraw.CaptureError, match="already running"):
        with cgraw.capture(pool=pool):
            with cgraw.capture(pool=pool):
                pass
    not_capturing(pool)


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        cgraw.capture(mode="bogus")
    with pytest.raises(TypeError):
        cgraw.capture(pool=object())


# ---------------------------------------------------------------- Tensor and DLPack


def test_tensor_zero_copy_torch_and_cupy(pool):
    data = rng.standard_normal((33, 17)).astype(np.float32)
    t = cgraw.Tensor.empty(data.shape, np.float32, pool=pool).copy_from_numpy(data)
    tt = torch.from_dlpack(t)
    assert tt.data_ptr() == t.ptr and tt.shape == (33, 17)
    assert np.array_equal(tt.cpu().numpy(), data)
    assert pool.consumer_holds.get(t.ptr) == 1
    ct = cp.from_dlpack(t)
    assert int(ct.data.ptr) == t.ptr
    tt.mul_(2.0)  # a write through torch is seen by CuPy and by the Tensor
    torch.cuda.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(ct), data * 2.0)
    np.testing.assert_array_equal(t.to_numpy(), data * 2.0)
    ca = cp.asarray(t)  # __cuda_array_interface__
    assert int(ca.data.ptr) == t.ptr
    del tt, ct, ca
    gc.collect()
    assert t.ptr not in pool.consumer_holds
    # legacy capsule
    cap = t.__dlpack__(stream=1)
    leg = torch.utils.dlpack.from_dlpack(cap)
    assert leg.data_ptr() == t.ptr
    del leg, cap, t
    gc.collect()


def test_from_dlpack_imports_frameworks():
    x = trand(10, 3)
    t = cgraw.from_dlpack(x)
    assert t.ptr == x.data_ptr() and t.shape == (10, 3) and t.dtype == np.float32
    np.testing.assert_array_equal(t.to_numpy(), x.cpu().numpy())
    c = crand(5, 4)
    t2 = cgraw.from_dlpack(c)
    assert t2.ptr == int(c.data.ptr)
    back = torch.from_dlpack(t2)
    assert back.data_ptr() == int(c.data.ptr)
    bf = torch.randn(4, 4, device="cuda").to(torch.bfloat16)
    tb = cgraw.from_dlpack(bf)
    assert tb.dtype == "bfloat16"
    assert torch.equal(torch.from_dlpack(tb), bf)


def test_tensor_consumer_stream_waits(pool):
    """A consumer on another stream sees the producer's writes (the export orders them)."""
    s = cgraw.Stream.create()
    data = rng.standard_normal(1 << 20).astype(np.float32)
    t = cgraw.Tensor.empty(data.shape, np.float32, pool=pool, stream=s)
    t.copy_from_numpy(data)
    ts = torch.cuda.Stream()
    with torch.cuda.stream(ts):
        tt = torch.from_dlpack(t)
        r = (tt * 2).sum()
    ts.synchronize()
    torch.testing.assert_close(r.cpu(), torch.tensor(float((data * 2).astype(np.float64).sum())), rtol=1e-4, atol=1e-2)
    del tt, t
    gc.collect()
    s.close()


def test_closed_pools_leave_no_torch_private_pool_behind(device):
    """Each capture's warm-up matmul makes torch's cuBLAS workspace for the pool's capture stream
    inside the pool's torch MemPool, and torch's (handle, stream) map holds it after the pool is
    closed: unless cgraw frees it first, every closed pool keeps one torch private pool and its segment
    (79 of them during test_cupy_libs.py). Read from torch's own segment table, not device-wide."""
    ids = []
    for i in range(4):
        a, b = trand(64, 64), trand(64, 32)
        p = cgraw.DevicePool(device, name=f"closed {i}")
        with cgraw.capture(pool=p) as g:
            y = torch.tanh(a @ b)
        a.copy_(trand(64, 64))
        g.replay()
        torch.testing.assert_close(y, torch.tanh(a @ b))
        ids.append(tuple(p.torch_state.id))
        del y
        p.close()  # closes g
        assert g.closed
    gc.collect()
    torch.cuda.synchronize()
    from cgraw.interop.torch import private_api

    left = {tuple(s["segment_pool_id"]) for s in private_api.memory_segments()} & set(ids)
    assert not left, f"torch private pools of closed cgraw pools still hold segments: {sorted(left)}"
    x = trand(64, 64)
    torch.testing.assert_close(x @ x, (x.cpu() @ x.cpu()).cuda(), rtol=1e-2, atol=1e-2)  # eager cuBLAS still works


def test_private_pool_memory_returns_when_graph_and_outputs_die(device):
    """Read in this process, not from the device's free memory: with other processes on the GPU
    (tools/gpu_session.sh parallel) the device-wide figure moves under this test."""
    import weakref

    from cgraw import _cuda

    x = cp.asarray(rng.standard_normal(16 << 20).astype(np.float32))  # 64 MiB input
    with cgraw.capture(frameworks=("cupy",)) as g:
        y = cp.exp(x) + 1.0
    pool, yptr = g.pool, int(y.data.ptr)
    assert pool.owns(yptr) and pool.stats().reserved_bytes >= 64 << 20  # y's 64 MiB: the graph's own pool
    seg = _cuda.mem_address_range(yptr)
    assert seg is not None and seg[1] >= 64 << 20  # a driver allocation of the pool's
    x[...] = cp.asarray(rng.standard_normal(16 << 20).astype(np.float32))
    g.replay()
    assert cp.array_equal(y, cp.exp(x) + 1.0)
    pool_ref = weakref.ref(pool)
    del pool, g, y
    gc.collect()
    assert pool_ref() is None
    assert _cuda.mem_address_range(seg[0]) is None  # the segment went back to the driver

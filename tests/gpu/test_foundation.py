"""GPU tier for the foundation: device, streams, events, DevicePool, the CuPy pool hook."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import cgraw
from cgraw import _cuda

pytestmark = pytest.mark.gpu

rng = np.random.default_rng()


def test_device_basics(device):
    assert cgraw.Device.count() >= 1
    assert cgraw.Device(0) is device
    assert "H200" in device.name or device.name  # a real name comes back
    free, total = device.mem_get_info()
    assert 0 < free <= total


def test_stream_owned_and_borrowed(device):
    s = cgraw.Stream.create(device)
    assert s.is_owned and s.ptr != 0
    assert s.__cuda_stream__() == (0, s.ptr)
    b = cgraw.Stream.from_handle(s.ptr, device)
    assert not b.is_owned and b == s
    b.close()  # a borrowed stream is never destroyed
    assert s.query()
    e = s.record()
    e.synchronize()
    assert e.query()
    s.close()
    s.close()  # idempotent


def test_stream_from_frameworks(device, torch_mod, cupy_mod):
    ts = torch_mod.cuda.Stream()
    s = cgraw.Stream.of(ts)
    assert s.ptr == ts.cuda_stream and not s.is_owned and s._owner is ts
    cs = cupy_mod.cuda.Stream(non_blocking=True)
    s2 = cgraw.Stream.of(cs)
    assert s2.ptr == cs.ptr


def test_pool_write_read_free(pool, device):
    n = 1 << 20
    data = rng.standard_normal(n // 4).astype(np.float32)
    t = cgraw.Tensor.empty(data.shape, np.float32, pool=pool)
    t.copy_from_numpy(data)
    np.testing.assert_array_equal(t.to_numpy(), data)
    assert pool.stats().live_blocks == 1
    del t
    gc.collect()
    assert pool.stats().live_blocks == 0


def test_cupy_arrays_through_pool_hook(pool, cupy_mod):
    cp = cupy_mod
    a_host = rng.standard_normal((257, 31)).astype(np.float32)
    b_host = rng.standard_normal((257, 31)).astype(np.float32)
    expected = np.tanh(a_host) * b_host + 1.5
    with cp.cuda.using_allocator(pool.cupy_allocator()):
        a = cp.asarray(a_host)
        b = cp.asarray(b_host)
        c = cp.tanh(a) * b + 1.5
        ptrs = {int(x.data.ptr) for x in (a, b, c)}
        assert all(pool.owns(p) for p in ptrs)
        assert pool.stats().live_blocks >= 3
    np.testing.assert_allclose(cp.asnumpy(c), expected, rtol=1e-6, atol=1e-6)
    del a, b, c
    gc.collect()
    cp.cuda.Device().synchronize()
    assert pool.stats().live_blocks == 0


def test_segment_growth_past_1GiB(pool):
    blocks = [pool.malloc(300 << 20) for _ in range(4)]  # 1.2 GiB
    st = pool.stats()
    assert st.reserved_bytes >= 1200 << 20
    assert st.allocated_bytes >= 1200 << 20
    data = rng.integers(0, 255, 4096, dtype=np.uint8)
    last = blocks[-1]
    _cuda.memcpy_htod(last.ptr + (300 << 20) - 4096, data.ctypes.data, 4096)
    back = np.empty_like(data)
    _cuda.memcpy_dtoh(back.ctypes.data, last.ptr + (300 << 20) - 4096, 4096)
    np.testing.assert_array_equal(back, data)
    for b in blocks:
        pool.free(b)


def test_close_returns_memory_to_driver(device):
    p = cgraw.DevicePool(device, name="close-test")
    free0, _ = device.mem_get_info()
    blocks = [p.malloc(512 << 20) for _ in range(4)]
    free1, _ = device.mem_get_info()
    assert free0 - free1 >= (2048 << 20) * 0.95
    for b in blocks:
        p.free(b)
    p.close()
    free2, _ = device.mem_get_info()
    assert free2 - free1 >= (2048 << 20) * 0.95
    with pytest.raises(cgraw.PoolClosed):
        p.malloc(1024)


def test_limit_raises_with_figures(device):
    p = cgraw.DevicePool(device, limit=64 << 20, name="limited")
    b = p.malloc(40 << 20)
    with pytest.raises(cgraw.PoolExhausted) as ei:
        p.malloc(40 << 20)
    assert ei.value.limit == 64 << 20 and ei.value.requested >= 40 << 20
    p.free(b)
    p.close()


def test_cuda_error_names_call(device):
    with pytest.raises(cgraw.CudaError) as ei:
        _cuda.check(_cuda.drv.cuDeviceGet(10_000), "cuDeviceGet")
    assert "cuDeviceGet: CUDA_ERROR_INVALID_DEVICE" in str(ei.value)
    assert ei.value.name == "CUDA_ERROR_INVALID_DEVICE"

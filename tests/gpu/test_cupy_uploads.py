"""GPU tier of upload staging (``cgraw/interop/cupy/staging.py``): host data that
``cupy._core.array`` receives inside a capture (``cupy.asarray``/``cupy.array`` of NumPy arrays,
scalars, lists) becomes a copy node from a pinned block the graph owns. Each case is compared with
eager CuPy (values, dtype, shape, memory order) and replayed after the host data and the output
were overwritten: the replays show the recording's values. CuPy 14.2 refuses its own copies
inside a capture, hence the staging."""

from __future__ import annotations

import numpy as np
import pytest

import cgraw

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
cupyx = pytest.importorskip("cupyx")

rng = np.random.default_rng()


def _pinned(shape, dtype):
    x = cupyx.empty_pinned(shape, dtype=dtype)
    x[...] = rng.standard_normal(shape).astype(dtype)
    return x


CASES = {  # name: (host data made fresh for each run, keyword arguments of cupy.array)
    "float32 C": (lambda: rng.standard_normal((33, 17)).astype(np.float32), {}),
    "float64 F": (lambda: np.asfortranarray(rng.standard_normal((9, 31))), {}),
    "F array to C": (lambda: np.asfortranarray(rng.standard_normal((9, 31))), {"order": "C"}),
    "strided": (lambda: rng.standard_normal((40, 12))[::3, 1::2], {}),
    "big-endian int32": (lambda: rng.integers(-1000, 1000, 77).astype(">i4"), {}),
    "complex64 from float64": (lambda: rng.standard_normal(50), {"dtype": np.complex64}),
    "ndmin": (lambda: rng.standard_normal(6).astype(np.float32), {"ndmin": 3}),
    "list with dtype": (lambda: [float(v) for v in rng.standard_normal(10)], {"dtype": np.float32}),
    "nested bools": (lambda: [[bool(v) for v in rng.integers(0, 2, 5)] for _ in range(3)], {}),
    "tuple of arrays": (lambda: tuple(rng.standard_normal(4) for _ in range(3)), {}),
    "python scalar": (lambda: float(rng.standard_normal()), {}),
    "numpy scalar": (lambda: np.int16(rng.integers(-100, 100)), {"dtype": np.float32}),
    "pinned numpy array": (lambda: _pinned((1000,), np.float32), {}),
    "blocking": (lambda: rng.standard_normal(64).astype(np.float32), {"blocking": True}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_host_data_uploads_like_eager_and_replays_the_recording(pool, name):
    make, kwargs = CASES[name]
    host = make()
    eager = cp.array(host, **kwargs)
    cp.cuda.runtime.deviceSynchronize()  # CuPy's eager copy from a pinned array reads it asynchronously
    with cgraw.capture(pool=pool) as g:
        y = cp.array(host, **kwargs)
    assert (y.shape, y.dtype, y.flags.c_contiguous, y.flags.f_contiguous) == \
        (eager.shape, eager.dtype, eager.flags.c_contiguous, eager.flags.f_contiguous)
    if isinstance(host, np.ndarray):
        host[...] = 0  # the graph copies the recording's bytes, never the host array
    for _ in range(3):
        y[...] = 1
        g.replay()
        cp.cuda.runtime.deviceSynchronize()
        cp.testing.assert_array_equal(y, eager)
    g.close()


def test_a_zero_size_upload_takes_no_block(pool):
    from cgraw.interop.cupy.staging import StagedUploads

    host = rng.standard_normal(3).astype(np.float32)
    recorded = host.copy()
    with cgraw.capture(pool=pool) as g:
        y = cp.asarray(np.zeros((0, 4), np.float32))
        z = cp.asarray(host) * 2
    held = [p for h in g._keepalive if isinstance(h, StagedUploads) for p in h.ptrs]
    assert (y.shape, y.dtype) == ((0, 4), cp.float32) and len(held) == 1  # z's upload only
    host[:] = 0
    g.replay()
    cp.testing.assert_array_equal(z, cp.asarray(recorded) * 2)
    g.close()


@pytest.mark.parametrize("fail", [False, True])
def test_cupys_array_function_is_put_back_after_the_capture(pool, fail):
    before = cp._core.array

    class Boom(Exception):
        pass

    try:
        with cgraw.capture(pool=pool) as g:
            assert cp._core.array is not before  # wrapped while the capture routes CuPy
            cp.asarray(np.ones(3, np.float32)) + 1
            if fail:
                raise Boom
    except Boom:
        assert fail
    else:
        g.close()
    assert cp._core.array is before
    cp.testing.assert_array_equal(cp.asarray(np.arange(5)), cp.arange(5))  # eager uploads are CuPy's own again

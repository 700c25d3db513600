"""GPU tier of ``cgraw.interop.cupy.mask``: ``a[mask] = scalar`` on CuPy arrays inside
``cgraw.capture()`` without CuPy's host count of the mask. Every replay gets new
values written in place and is compared with eager CuPy on the same values."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import cgraw

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

rng = np.random.default_rng()


def fresh(shape, dtype):
    x = rng.standard_normal(shape) * 10
    return cp.asarray(x.astype(dtype))


def routed_off():
    assert "__setitem__" not in cp.ndarray.__dict__  # the class is CuPy's again


CASES = {  # name: (function of x writing into a copy of it, input shape)
    "x[x < 0] = 0": (lambda x: _set(x, lambda y: y < 0, 0), (64, 33)),
    "rows through a 1-d mask = 2.5": (lambda x: _set(x, lambda y: y[:, 0] > 0, 2.5), (64, 33)),
    "3-d, mask over two axes = numpy scalar": (lambda x: _set(x, lambda y: y[..., 1] < 1, np.float32(-7)),
                                                (8, 9, 5)),
    "0-d CuPy value": (lambda x: _set(x, lambda y: y > 3, cp.asarray(11, dtype=y_dtype(x))), (300,)),
    "non-contiguous target": (lambda x: _strided(x), (40, 30)),
}


def _strided(x):
    y = x * 1
    v = y[:, ::2]  # a non-contiguous view: the assignment writes through it into y
    v[v < 0] = 1
    return y


def y_dtype(x):
    return x.dtype


def _set(x, mask_of, value):
    y = x * 1  # a new array inside the capture, as library code makes them
    y[mask_of(y)] = value
    return y


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_scalar_through_a_boolean_mask_captures_and_replays_equal_eager(pool, case, dtype):
    f, shape = CASES[case]
    x = fresh(shape, dtype)
    f(x)
    with cgraw.capture(pool=pool) as g:
        out = f(x)
    routed_off()
    previous = None
    for _ in range(3):
        x[...] = fresh(shape, dtype)
        g.replay()
        cp.testing.assert_array_equal(out, f(x))  # the same elementwise work: bit for bit
        assert previous is None or not cp.array_equal(out, previous)
        previous = out.copy()
    g.close()
    del out


def test_library_functions_that_mask_a_scalar_now_capture(pool):
    from cupyx.scipy import special

    x = fresh((16, 24), "float32")
    x[0, :] = -np.inf  # the row whose max is not finite: the masked assignment has work to do
    a = fresh((16, 8), "float64")
    b = fresh((8,), "float64")
    fns = (lambda: special.logsumexp(x, axis=1), lambda: special.log_softmax(x, axis=1),
           lambda: cp.linalg.pinv(a), lambda: cp.linalg.lstsq(a.T, b)[0])  # lstsq with m <= n (see below)
    for fn in fns:
        fn()
    with cgraw.capture(pool=pool) as g:
        outs = [fn() for fn in fns]
    for _ in range(2):
        x[1:] = fresh((15, 24), "float32")
        a[...] = fresh((16, 8), "float64")
        b[...] = fresh((8,), "float64")
        g.replay()
        for got, fn in zip(outs, fns, strict=True):
            want = fn()
            cp.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * max(1.0, float(cp.abs(want[cp.isfinite(
                want)]).max())))
    g.close()
    del outs
    tall, rhs = fresh((16, 8), "float64"), fresh((16,), "float64")
    with pytest.raises(cgraw.CaptureError, match="host synchronisation"):
        with cgraw.capture(pool=pool):
            cp.linalg.lstsq(tall, rhs)  # m > n: CuPy tests rank != n on the host for the residuals
    routed_off()


def test_an_array_value_through_a_mask_is_still_a_named_host_synchronisation(pool):
    x = fresh((50,), "float32")
    vals = fresh((50,), "float32")
    want = x.copy()
    want[want < 0] = vals[: int((want < 0).sum())]
    with pytest.raises(cgraw.CaptureError, match="host synchronisation"):
        with cgraw.capture(pool=pool):
            y = x * 1
            y[y < 0] = vals[:10]  # values in the mask's order: CuPy counts on the host
    routed_off()
    y = x.copy()
    y[y < 0] = vals[: int((y < 0).sum())]  # eager CuPy as before
    cp.testing.assert_array_equal(y, want)


def test_another_thread_assigns_eagerly_during_a_capture(pool):
    x = fresh((1000,), "float64")
    other = fresh((1000,), "float64")
    want = other.copy()
    want[want < 0] = 0
    started, done, seen = threading.Event(), threading.Event(), {}

    def worker():
        started.wait(10)
        y = other.copy()
        y[y < 0] = 0  # CuPy's own path, on this thread's stream
        cp.cuda.get_current_stream().synchronize()
        seen["y"] = y
        done.set()

    t = threading.Thread(target=worker)
    t.start()
    with cgraw.capture(pool=pool) as g:
        out = x * 1
        out[out > 0] = -1
        started.set()
        assert done.wait(30)
    t.join(10)
    cp.testing.assert_array_equal(seen["y"], want)
    x[...] = fresh((1000,), "float64")
    g.replay()
    ref = x * 1
    ref[ref > 0] = -1
    cp.testing.assert_array_equal(out, ref)
    g.close()
    del out

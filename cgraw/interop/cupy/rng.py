"""``cupy.random`` inside captures, drawn by cgraw's Philox kernels.

Layer L7: CuPy is imported lazily; kernels are reached through ``rng.device``.

CuPy's module functions (``cupy.random.random``, ``rand``, ``randn``, ``standard_normal``,
``normal``, ``uniform``, ``randint``, ``choice``, ``gamma``, ``beta``, ``poisson``,
``binomial``, ...) draw from the device's ``RandomState``,
which calls cuRAND, and cuRAND refuses stream capture. During a capture cgraw puts a
``CaptureRandomState`` in CuPy's table of states for the capture's device: on the capturing
thread it draws from the graph's stream, on any other thread it forwards to CuPy's own state.
After the capture CuPy's own state is back, untouched by the capture itself.

Replays follow CuPy's generator of the graph's device (``CupyRng.use``): its ``_rk_seed``, which
``cupy.random.seed`` sets and CuPy's own kernels advance by the elements they draw, is the
generator position each replay reads and advances by the elements it draws (``rng.plan.rk_sync``). So
``cupy.random.seed(s)`` governs the numbers replays draw, and CuPy's eager draws that go through
``_rk_seed`` (gamma, beta, poisson, binomial, ...) see what the replays consumed; its cuRAND
draws (``random``, ``normal``, ...) keep cuRAND's own offset, which neither reads.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

from cgraw import _cuda
from cgraw.rng import plan as rng, device as rng_device
from cgraw.errors import CaptureError

_CODES = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64", np.dtype(np.float16): "f16",
          np.dtype(np.int8): "i8", np.dtype(np.uint8): "u8", np.dtype(np.int16): "i16",
          np.dtype(np.int32): "i32", np.dtype(np.int64): "i64", np.dtype(np.bool_): "b8"}
COVERED = ("random_sample", "random", "rand", "randn", "standard_normal", "normal", "lognormal", "uniform",
           "randint", "random_integers", "choice", "permutation", "shuffle", "standard_exponential", "exponential",
           "standard_gamma", "gamma", "beta", "poisson", "binomial")
_INTS = (np.dtype(np.int32), np.dtype(np.int64))
_LAM_MAX = float(np.iinfo(np.int64).max - np.sqrt(np.iinfo(np.int64).max) * 10)  # NumPy's poisson bound


def _not_covered(name: str, why: str = "cgraw draws its own numbers inside captures and does not cover it"):
    return CaptureError(f"cupy.random.{name}", 0, "RNG_NOT_COVERED",
                        f"cupy.random.{name} cannot be captured ({why})",
                        "draw the random array outside the capture and pass it in, or use one of "
                        + ", ".join(COVERED))


def _shape(size) -> tuple:
    if size is None:
        return ()
    if isinstance(size, (int, np.integer)):
        return (int(size),)
    return tuple(int(s) for s in size)


def _scalar(name: str, what: str, v) -> float:
    """A host scalar parameter; array parameters (per-element laws) are not covered."""
    if isinstance(v, (int, float, np.integer, np.floating)):
        return float(v)
    if hasattr(v, "shape"):
        raise _not_covered(name, f"an array {what} is not supported (pass a Python or NumPy scalar)")
    return float(v)


class CaptureRandomState:
    """Stands in for the device's ``cupy.random.RandomState`` during one capture."""

    def __init__(self, stream: rng.RngStream, original, device: int):
        self._rs = stream
        self._original = original
        self._device = device
        self._thread = threading.get_ident()

    def _mine(self) -> bool:
        return threading.get_ident() == self._thread

    def _orig(self):
        if self._original is None:
            self._original = sys.modules["cupy"].random.RandomState()
        return self._original

    def __getattr__(self, name):
        # only reached for methods this class does not define
        if self._mine():
            raise _not_covered(name)
        return getattr(self._orig(), name)

    # -- drawing
    def _fill(self, shape, dtype, dist: str, *, a=0.0, b=0.0, lo=0, rng_range=0):
        cupy = sys.modules["cupy"]
        dtype = np.dtype(dtype)
        code = _CODES.get(dtype)
        if code is None:
            raise _not_covered(dist, f"dtype {dtype} is not supported")
        out = cupy.empty(shape, dtype=dtype)
        stream = _cuda.stream_handle(cupy.cuda.get_current_stream().ptr)
        rng_device.fill(self._rs, dist, code, out.data.ptr, out.size, stream, a=a, b=b, lo=lo, rng_range=rng_range,
                     wide=rng.is_wide(dist, code, rng_range))
        return out

    def _float(self, name, dtype):
        dtype = np.dtype(dtype)
        if dtype.char not in "fd":
            raise TypeError(f"cupy.random.{name}: dtype must be float32 or float64, not {dtype}")
        return dtype

    def random_sample(self, size=None, dtype=float):
        if not self._mine():
            return self._orig().random_sample(size=size, dtype=dtype)
        return self._fill(_shape(size), self._float("random_sample", dtype), "uniform", a=0.0, b=1.0)

    random = random_sample

    def rand(self, *size, **kwarg):
        if not self._mine():
            return self._orig().rand(*size, **kwarg)
        return self.random_sample(size=size, dtype=kwarg.pop("dtype", float))

    def randn(self, *size, **kwarg):
        if not self._mine():
            return self._orig().randn(*size, **kwarg)
        return self.normal(size=size, dtype=kwarg.pop("dtype", float))

    def standard_normal(self, size=None, dtype=float):
        if not self._mine():
            return self._orig().standard_normal(size=size, dtype=dtype)
        return self.normal(size=size, dtype=dtype)

    def _param_shape(self, size, *params):
        arrays = [p for p in params if hasattr(p, "shape")]
        if size is not None or not arrays:
            return _shape(size), arrays
        return tuple(np.broadcast_shapes(*(tuple(p.shape) for p in arrays))), arrays

    def normal(self, loc=0.0, scale=1.0, size=None, dtype=float):
        if not self._mine():
            return self._orig().normal(loc=loc, scale=scale, size=size, dtype=dtype)
        dtype = self._float("normal", dtype)
        shape, arrays = self._param_shape(size, loc, scale)
        if not arrays:
            return self._fill(shape, dtype, "normal", a=float(loc), b=float(scale))
        z = self._fill(shape, dtype, "normal", a=0.0, b=1.0)
        return (z * scale + loc).astype(dtype, copy=False)

    def lognormal(self, mean=0.0, sigma=1.0, size=None, dtype=float):
        if not self._mine():
            return self._orig().lognormal(mean=mean, sigma=sigma, size=size, dtype=dtype)
        x = self.normal(mean, sigma, size=size, dtype=dtype)
        return sys.modules["cupy"].exp(x, out=x)  # as CuPy does for array parameters

    def _permutation(self, n: int):
        """A permuted ``arange(n)`` (int64): the argsort of ``n`` uniform keys, as CuPy sorts its
        random int32s (a tie of two float64 keys still yields a permutation)."""
        return sys.modules["cupy"].argsort(self._fill((n,), np.float64, "uniform", a=0.0, b=1.0))

    def permutation(self, a):
        if not self._mine():
            return self._orig().permutation(a)
        return self._permutation(a) if isinstance(a, int) else a[self._permutation(len(a))]

    def shuffle(self, a):
        if not self._mine():
            return self._orig().shuffle(a)
        if not isinstance(a, sys.modules["cupy"].ndarray):
            raise TypeError("The array must be cupy.ndarray")
        if a.ndim == 0:
            raise TypeError("An array whose ndim is 0 is not supported")
        a[:] = a[self._permutation(len(a))]

    def uniform(self, low=0.0, high=1.0, size=None, dtype=float):
        if not self._mine():
            return self._orig().uniform(low=low, high=high, size=size, dtype=dtype)
        dtype = self._float("uniform", dtype)
        shape, arrays = self._param_shape(size, low, high)
        if not arrays:
            return self._fill(shape, dtype, "uniform", a=float(low), b=float(high))
        u = self._fill(shape, dtype, "uniform", a=0.0, b=1.0)
        return (low + (high - low) * u).astype(dtype, copy=False)

    def standard_exponential(self, size=None, dtype=float):
        if not self._mine():
            return self._orig().standard_exponential(size=size, dtype=dtype)
        return self._fill(_shape(size), self._float("standard_exponential", dtype), "exponential", a=1.0)

    def exponential(self, scale=1.0, size=None, dtype=float):
        if not self._mine():
            return self._orig().exponential(scale=scale, size=size, dtype=dtype)
        if hasattr(scale, "shape"):
            raise _not_covered("exponential", "an array scale is not supported")
        return self._fill(_shape(size), self._float("exponential", dtype), "exponential", a=1.0 / float(scale))

    # -- rejection samplers (rng.kernels.SAMPLERS): NumPy's argument checks, scalar parameters
    def _sample(self, name, size, dtype, dist, a, b=0.0, *, ints=False, top=0.0):
        """``top``: the largest value the draw can take (an integer law), checked against the dtype."""
        dtype = np.dtype(dtype)
        if ints:
            if dtype not in _INTS:
                raise _not_covered(name, f"dtype {dtype} is not supported (int32 or int64)")
            if top > np.iinfo(dtype).max:  # the kernel would wrap, silently
                raise _not_covered(name, f"its draws can exceed {dtype}'s range; use dtype=int64")
        else:
            dtype = self._float(name, dtype)
        cupy = sys.modules["cupy"]
        out = cupy.empty(_shape(size), dtype=dtype)
        code = _CODES[dtype]
        stream = _cuda.stream_handle(cupy.cuda.get_current_stream().ptr)
        rng_device.sample(self._rs, dist, code, out.data.ptr, out.size, stream, a, b, wide=rng.is_wide(dist, code))
        return out

    def standard_gamma(self, shape, size=None, dtype=float):
        if not self._mine():
            return self._orig().standard_gamma(shape, size=size, dtype=dtype)
        k = _scalar("standard_gamma", "shape", shape)
        if not k >= 0:
            raise ValueError("shape < 0")
        return self._sample("standard_gamma", size, dtype, "gamma", k, 1.0)

    def gamma(self, shape, scale=1.0, size=None, dtype=float):
        if not self._mine():
            return self._orig().gamma(shape, scale=scale, size=size, dtype=dtype)
        k, theta = _scalar("gamma", "shape", shape), _scalar("gamma", "scale", scale)
        if not k >= 0:
            raise ValueError("shape < 0")
        if not theta >= 0:
            raise ValueError("scale < 0")
        return self._sample("gamma", size, dtype, "gamma", k, theta)

    def beta(self, a, b, size=None, dtype=float):
        if not self._mine():
            return self._orig().beta(a, b, size=size, dtype=dtype)
        fa, fb = _scalar("beta", "a", a), _scalar("beta", "b", b)
        if not fa > 0:
            raise ValueError("a <= 0")
        if not fb > 0:
            raise ValueError("b <= 0")
        return self._sample("beta", size, dtype, "beta", fa, fb)

    def poisson(self, lam=1.0, size=None, dtype=int):
        if not self._mine():
            return self._orig().poisson(lam=lam, size=size, dtype=dtype)
        lam = _scalar("poisson", "lam", lam)
        if not lam >= 0:
            raise ValueError("lam < 0")
        if lam > _LAM_MAX:
            raise ValueError("lam value too large")
        return self._sample("poisson", size, dtype, "poisson", lam, ints=True, top=lam + 10.0 * lam ** 0.5 + 10.0)

    def binomial(self, n, p, size=None, dtype=int):
        if not self._mine():
            return self._orig().binomial(n, p, size=size, dtype=dtype)
        fn, fp = _scalar("binomial", "n", n), _scalar("binomial", "p", p)
        if fp != fp:
            raise ValueError("p is nan")
        if fn < 0:
            raise ValueError("n < 0")
        if fp < 0:
            raise ValueError("p < 0")
        if fp > 1:
            raise ValueError("p > 1")
        if fn > 2 ** 53:
            raise _not_covered("binomial", "n above 2**53 is not supported")
        return self._sample("binomial", size, dtype, "binomial", float(int(fn)), fp, ints=True,
                            top=float(int(fn)) if fp > 0 else 0.0)

    def randint(self, low, high=None, size=None, dtype="l"):
        if not self._mine():
            return self._orig().randint(low, high=high, size=size, dtype=dtype)
        if hasattr(low, "shape") or hasattr(high, "shape"):
            raise _not_covered("randint", "array bounds are not supported")
        lo, hi = (0, int(low)) if high is None else (int(low), int(high))
        if hi <= lo:
            raise ValueError(f"cupy.random.randint: low >= high ({lo} >= {hi})")
        return self._fill(_shape(size), dtype, "randint", lo=lo, rng_range=hi - lo)

    def random_integers(self, low, high=None, size=None):
        if not self._mine():
            return self._orig().random_integers(low, high=high, size=size)
        lo, hi = (1, int(low)) if high is None else (int(low), int(high))
        return self.randint(lo, hi + 1, size=size)

    def choice(self, a, size=None, replace=True, p=None):
        if not self._mine():
            return self._orig().choice(a, size=size, replace=replace, p=p)
        cupy = sys.modules["cupy"]
        if isinstance(a, (int, np.integer)):
            n, values = int(a), None
        else:
            values = cupy.asarray(a) if not hasattr(a, "shape") else a
            if values.ndim != 1:
                raise ValueError("cupy.random.choice: a must be 1-dimensional or an integer")
            n = int(values.shape[0])
        if n <= 0:
            raise ValueError("cupy.random.choice: a must be non-empty")
        shape = _shape(size)
        k = int(np.prod(shape)) if shape else 1
        if p is not None:
            p = cupy.asarray(p, dtype=cupy.float64)
            if p.ndim != 1 or int(p.shape[0]) != n:
                raise ValueError("cupy.random.choice: p must be 1-dimensional and as long as a")
        if replace:
            if p is None:
                idx = self.randint(0, n, size=shape)
            else:
                c = cupy.cumsum(p)
                u = self._fill(shape, np.float64, "uniform", a=0.0, b=1.0)
                idx = cupy.minimum(cupy.searchsorted(c, u * c[-1], side="right"), n - 1)
        else:
            if k > n:
                raise ValueError("cupy.random.choice: cannot take a larger sample than the population "
                                 "when replace=False")
            if p is None:
                keys = self._fill((n,), np.float64, "uniform", a=0.0, b=1.0)
            else:
                keys = p / self._fill((n,), np.float64, "exponential", a=1.0)
            idx = cupy.argsort(-keys)[:k].reshape(shape)
        return idx if values is None else values[idx]


class WarmRandomState(CaptureRandomState):
    """``CaptureRandomState`` of a graphed function's warm-up, which runs the function eagerly: a
    draw cgraw does not cover (a method, a dtype, an array parameter) is CuPy's own, as eagerly,
    never refused."""

    def __getattribute__(self, name):
        attr = object.__getattribute__(self, name)
        if name.startswith("_") or not callable(attr):
            return attr

        def draw(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            except (CaptureError, ValueError):  # not covered: CuPy draws it (and raises what it raises)
                return getattr(self._orig(), name)(*args, **kwargs)

        return draw

    def __getattr__(self, name):
        return getattr(self._orig(), name)


class CupyRng:
    """Puts a ``CaptureRandomState`` in CuPy's table for the capture's device, and takes it out
    (``eager``: a ``WarmRandomState``, for a warm-up)."""

    def __init__(self, stream: rng.RngStream, device: int, source: rng.Source | None = None, *, eager: bool = False):
        self.stream = stream
        self.device = device
        self.source = source
        self.eager = eager
        self._states = None
        self._had = False
        self._before = None
        self._sub = None

    def enter(self) -> None:
        states = getattr(_generator_module(), "_random_states", None)
        if not isinstance(states, dict):
            return  # another CuPy: cupy.random fails as before
        self._states = states
        self._had = self.device in states
        self._before = states.get(self.device)
        self._sub = (WarmRandomState if self.eager else CaptureRandomState)(self.stream, self._before, self.device)
        states[self.device] = self._sub

    def original(self):
        """CuPy's own ``RandomState`` of the device while the stand-in is in its table (made as
        ``CaptureRandomState`` makes it when the table had none)."""
        return self._sub._orig()

    def use(self) -> rng.RkUse:
        """What replays of the captured graph do with CuPy's generator of its device: read and
        advance its ``_rk_seed`` (``rng.plan.rk_sync``)."""
        s = self.stream
        return rng.RkUse(_generator_module(), s.device, self.source, s.calls, s.elements, _make_state)

    def exit(self) -> None:
        states, self._states = self._states, None
        if states is None:
            return
        sub, self._sub = self._sub, None
        if states.get(self.device) is sub:
            original = sub._original  # made on another thread during the capture, if it was None
            if original is not None:
                states[self.device] = original
            else:
                states.pop(self.device, None)


def router(stream: rng.RngStream, source: rng.Source) -> CupyRng:
    """The router of one capture (``capture`` makes one per framework it routes)."""
    return CupyRng(stream, stream.device, source)


class WarmDraws(rng_device.WarmUp):
    """A graphed function's warm-up draws CuPy's random numbers on ``device`` with cgraw's kernels,
    at the offsets its recording will take, and moves CuPy's generator as a replay does
    (``rng.plan.RkWarm``): after the same ``cupy.random.seed``, the warm-up's numbers are those a
    replay of the recording draws. What cgraw does not cover is CuPy's own (``WarmRandomState``)."""

    __slots__ = ()

    def __init__(self, device: int):
        cupy = sys.modules["cupy"]
        thread = threading.get_ident()
        self._cu = _cuda.stream_handle(cupy.cuda.get_current_stream().ptr)
        src = rng_device.source(device, rng.CUPY, self._cu, thread)
        # CuPy's own RandomState moves, not the stand-in its table holds while the warm-up runs
        self._warm = rng.RkWarm(lambda: self._router.original(), src, self._cu)
        self._router = CupyRng(rng.WarmStream(src.slot, device, thread, self._warm), device, src, eager=True)



def drawing() -> bool:
    """Whether ``cupy.random`` is in use in this process (its generator module is loaded)."""
    return "cupy.random._generator" in sys.modules


def _generator_module():
    """``cupy.random._generator``: its ``_random_states`` is CuPy's table of per-device states
    (looked up at each use: ``cupy.random.reset_states`` replaces the table)."""
    gen = sys.modules.get("cupy.random._generator")
    if gen is None:
        import importlib

        gen = importlib.import_module("cupy.random._generator")
    return gen


def _make_state(device: int):
    """CuPy's ``RandomState`` of ``device``, made as ``cupy.random`` makes it on first use."""
    cupy = sys.modules["cupy"]
    with cupy.cuda.Device(device):
        return cupy.random.get_random_state()
